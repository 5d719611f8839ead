"""Where a process runs, and whether it still does (psutil).

A pid names one process only within one host, boot and pid namespace, and only until it
is reused: a record of a run's worker keeps all four, with the time it was made, so that
a later run can tell a dead worker from a live one, or from a newer process with its pid.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

# Set in a watched run worker: every process it starts inherits it (a managed vLLM server
# runs in its own session and outlives a killed worker, holding the accelerator).
RUN_ENV = "MM_ASSETS_RUN_ID"
_GONE = {psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD}


@dataclass(frozen=True)
class Machine:
    """What tells two processes apart across machines, reboots and containers."""

    host: str
    boot: str
    pid_namespace: str

    @classmethod
    def this(cls) -> Machine:
        try:  # containers on one host share its boot but not its pids; psutil does not say this
            pid_namespace = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_namespace = ""
        return cls(socket.gethostname(), f"{psutil.boot_time():.0f}", pid_namespace)


def process_alive(pid: int, recorded_at: float) -> bool:
    """Whether the process `pid`, recorded at `recorded_at`, still runs. A zombie is dead;
    a process started after the record is another one that reuses the pid."""
    try:
        process = psutil.Process(pid)
        if process.status() in _GONE:
            return False
        return process.create_time() <= recorded_at + 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # it exists, under another user


def processes_of(run_id: str) -> list[tuple[int, str]]:
    """Live processes on this machine started by a worker of `run_id` (they inherited
    `RUN_ENV`), with the start of their command. Another user's processes, whose
    environment cannot be read, are not listed."""
    found = []
    for process in psutil.process_iter(["pid", "environ", "cmdline", "status"]):
        info = process.info
        ours = (info["environ"] or {}).get(RUN_ENV) == run_id and info["pid"] != os.getpid()
        if ours and info["status"] not in _GONE:
            found.append((info["pid"], " ".join(info["cmdline"] or [])[:60]))
    return found


def stop_processes(pids: Sequence[int], grace_s: float = 10.0) -> None:
    """SIGTERM each (a vLLM server shuts down its engine on it), then SIGKILL what is
    left after `grace_s`."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.kill()
    psutil.wait_procs(alive, timeout=5)
