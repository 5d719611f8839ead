"""Run a command that must not outlive the process that started it, nor leave orphans.

A managed vLLM server runs in its own session, so that stopping it ends every worker it
forked; but when the step that started it is SIGKILLed, nothing stops the server, and
when the API process alone is killed, its `EngineCore` lives on. This guard leads a
process group of its own and starts the command in it; when the command exits, or the
guard's parent is gone, it ends the rest of the group (SIGTERM, then SIGKILL) and exits
with the command's status.

    python -m mm_assets.clients.parent_guard PARENT_PID -- COMMAND [ARGS...]
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
GRACE_S = 10.0
_GONE = {psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD}


def _others() -> list[psutil.Process]:
    """The live processes of the guard's group, but the guard."""
    group, me, found = os.getpgrp(), os.getpid(), []
    for process in psutil.process_iter(["status"]):
        if process.pid == me or process.info["status"] in _GONE:
            continue
        with contextlib.suppress(OSError):  # gone meanwhile
            if os.getpgid(process.pid) == group:
                found.append(process)
    return found


def _end_group() -> None:
    """SIGTERM the group (the guard ignores it), then SIGKILL what outlives the grace, one
    by one: a SIGKILL to the group would end the guard before it reports the status."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgrp(), signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while (left := _others()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for _ in range(50):  # what was forked meanwhile is found in the next round
        if not left:
            return
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()
        time.sleep(0.1)
        left = _others()


def guard(parent: int, command: list[str]) -> int:
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # a group of its own: the one it ends, and nothing outside it
    child = subprocess.Popen(command)
    # A SIGTERM to the group reaches the command too: wait for it to finish shutting down.
    signal.signal(signal.SIGTERM, lambda *_: None)
    while child.poll() is None and os.getppid() == parent:
        time.sleep(POLL_S)
    _end_group()  # the command's orphans (vLLM's EngineCore), or the command itself
    code = child.wait()
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell says


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit(__doc__)
    return guard(int(argv[0]), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
