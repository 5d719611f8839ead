"""Where a process runs, whether it still does, and which run's processes run here (psutil).

A pid names one process only within one host, boot and pid namespace, and only until it
is reused: a `ProcessId` keeps all of them with the process's create time, so that a dead
process is told from a live one, and from a newer process that took its pid. A run's
worker records one (`dead_runs.py`), every process a run starts carries one in its marker
(`RUN_ENV`: the run and the process that set it), and a process is signalled only while it
is still the one scanned.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import psutil

# Set in a watched run's worker and step processes: every process they start inherits it (a
# managed vLLM server runs in its own session and outlives a killed worker, holding the
# accelerator). Its value: `RunMark.encode()`.
RUN_ENV = "MM_ASSETS_RUN_ID"
_GONE = {psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD}
# Create times are boot time + clock ticks, and the boot time psutil reads moves when the
# wall clock is stepped; a newer process gets a pid only after every other pid was handed
# out since the last one with it started.
_SAME_START_S = 1.0


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


@dataclass(frozen=True)
class ProcessId:
    """One process for good: its machine, its pid, and when it started."""

    machine: Machine
    pid: int
    created: float

    @classmethod
    def of(cls, process: psutil.Process) -> ProcessId:
        """`process`, which runs on this machine."""
        return cls(Machine.this(), process.pid, process.create_time())

    @classmethod
    def this(cls) -> ProcessId:
        return cls.of(psutil.Process())

    def here(self) -> bool:
        return self.machine == Machine.this()

    def process(self) -> psutil.Process | None:
        """The process, while it runs here: None once it is gone, a zombie, or its pid
        belongs to a newer process. The psutil object then refuses to signal a later one."""
        if not self.here():
            return None
        try:
            process = psutil.Process(self.pid)
            if abs(process.create_time() - self.created) > _SAME_START_S:
                return None
            return None if process.status() in _GONE else process
        except psutil.NoSuchProcess:
            return None

    def gone(self) -> bool:
        """Whether it provably no longer runs: it ran here and is no more. One elsewhere,
        or here under another user where /proc hides it, is not known to be gone."""
        try:
            return self.here() and self.process() is None
        except psutil.AccessDenied:
            return False

    def fields(self) -> dict[str, object]:
        return {"pid": self.pid, "created": self.created, **asdict(self.machine)}

    @classmethod
    def from_fields(cls, value: dict) -> ProcessId:
        """From `fields()` read back: anything else raises KeyError, TypeError or ValueError."""
        machine = Machine(str(value["host"]), str(value["boot"]), str(value["pid_namespace"]))
        pid, created = value["pid"], value["created"]
        real = isinstance(created, (int, float)) and math.isfinite(created)
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not real:
            raise ValueError(f"not a process: pid {pid!r}, created {created!r}")
        return cls(machine, pid, float(created))


@dataclass(frozen=True)
class RunMark:
    """A run and one process of it: the worker a run records, or the process that set the
    marker its children inherit. Read from a run tag or an environment anyone can write,
    so `decode` trusts nothing and gives None for anything malformed."""

    run_id: str
    by: ProcessId

    def encode(self) -> str:
        return json.dumps({"run_id": self.run_id, **self.by.fields()}, sort_keys=True)

    @classmethod
    def decode(cls, text: str | None) -> RunMark | None:
        try:
            value = json.loads(text or "")
            return cls(str(value["run_id"]), ProcessId.from_fields(value))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Marked:
    """A live process here that carries a run's marker: who it is, who marked it."""

    id: ProcessId
    by: ProcessId
    command: str


def processes_of(run_id: str) -> list[Marked]:
    """Live processes on this machine started by a worker of `run_id` (they inherited its
    marker), except this one. Another user's processes, whose environment cannot be read,
    are not listed."""
    found = []
    here, me = Machine.this(), os.getpid()
    for process in psutil.process_iter(["environ", "cmdline", "status", "create_time"]):
        info = process.info
        mark = RunMark.decode((info["environ"] or {}).get(RUN_ENV))
        if mark is None or mark.run_id != run_id or process.pid == me:
            continue
        if info["status"] not in _GONE and info["create_time"] is not None:
            command = " ".join(info["cmdline"] or [])[:60]
            this = ProcessId(here, process.pid, info["create_time"])
            found.append(Marked(this, mark.by, command))
    return found


def _signal(target: ProcessId, kill: bool) -> psutil.Process | None:
    """SIGTERM (or SIGKILL) `target` if it is still the process recorded: checked right
    before, and psutil checks its create time again as it signals."""
    process = target.process()
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        if process is not None:
            (process.kill if kill else process.terminate)()
            return process
    return None


def stop_processes(targets: Sequence[ProcessId], grace_s: float = 10.0) -> None:
    """SIGTERM each (a vLLM server shuts down its engine on it), then SIGKILL what is
    left after `grace_s`. A pid now held by a newer process is never signalled."""
    signalled = [p for target in targets if (p := _signal(target, kill=False)) is not None]
    _, alive = psutil.wait_procs(signalled, timeout=grace_s)
    left = {process.pid for process in alive}
    killed = [p for t in targets if t.pid in left and (p := _signal(t, kill=True)) is not None]
    psutil.wait_procs(killed, timeout=5)
