"""Named places where a chaos run kills the process (`bench/chaos.py`, `make chaos`).

A SIGKILL between a file's fsync and its rename is hard to hit by timing alone, so such
places are named here, and a chaos run asks for a kill at the n-th time one is reached:

    MM_ASSETS_CRASH_AT=before_rename:7         SIGKILL this process there
    MM_ASSETS_CRASH_AT=before_rename:7:group   SIGKILL its whole process group
    MM_ASSETS_CRASH_LOG=/path/points.log       append each point's name as it is reached

Unset (always, outside a chaos run), a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

AT_ENV = "MM_ASSETS_CRASH_AT"
LOG_ENV = "MM_ASSETS_CRASH_LOG"
POINTS = (
    "table_write",  # a Parquet batch written, the file not yet closed
    "before_rename",  # a file written and fsynced, not yet renamed into place
    "after_epoch",  # a training state saved, the next epoch not started
    "measurement",  # the measuring vLLM server up, nothing generated yet
)

_reached: Counter[str] = Counter()


def crash_point(name: str) -> None:
    """Kill the process here if a chaos run asked for this point's current count."""
    log = os.environ.get(LOG_ENV)
    spec = os.environ.get(AT_ENV)
    if not log and not spec:
        return
    _reached[name] += 1
    if log:
        with open(log, "a") as fh:
            fh.write(f"{name}\n")
    if not spec:
        return
    point, _, rest = spec.partition(":")
    nth, _, scope = rest.partition(":")
    if point == name and _reached[name] == int(nth or 1):
        if scope == "group":
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
