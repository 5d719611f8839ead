"""Run a command that must not outlive the process that started it.

A managed vLLM server runs in its own session, so that stopping it ends every worker it
forked. The price: when the step that started it is killed outright (SIGKILL: the OOM
killer, a preempted node, a chaos run), nothing stops the server, which keeps its memory,
its cores and the accelerator. This guard is the session's first process: it starts the
command in its own process group, and when its parent is gone it ends the group (SIGTERM,
then SIGKILL). Otherwise it only waits, and exits with the command's status; a SIGTERM to
the group (the normal stop) lets the command shut down before the guard exits.

    python -m mm_assets.clients.parent_guard PARENT_PID -- COMMAND [ARGS...]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0


def _end_group(child: subprocess.Popen[bytes]) -> int:
    """SIGTERM the group (the guard ignores it), then SIGKILL whatever outlives the grace."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgrp(), signal.SIGTERM)
    try:
        return child.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # ends the guard too
        return child.wait()


def guard(parent: int, command: list[str]) -> int:
    child = subprocess.Popen(command)
    # A SIGTERM to the group reaches the command too: wait for it to finish shutting down.
    signal.signal(signal.SIGTERM, lambda *_: None)
    while True:
        code = child.poll()
        if code is not None:
            return code if code >= 0 else 128 - code  # killed by a signal: as a shell says
        if os.getppid() != parent:  # orphaned: the parent is gone
            return _end_group(child)
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit(__doc__)
    return guard(int(argv[0]), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
