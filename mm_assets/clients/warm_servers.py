"""Managed vLLM servers kept running between the steps of one process.

A chain starts several servers that are the same server: the held-out measurement and the
benchmark serve the same draft; the no-speculation benchmark and the next dataset's
replies serve the plain target. Each start costs ~20 s on CPU and minutes on a GPU
(weights, graphs). With `keep_warm` = N, a step that ends well parks its server here
instead of stopping it, and a later step of this process that asks for the same target,
serve arguments and options takes it over. At most N wait; the one parked longest ago is
stopped to make room, and all of them when the process exits (a guard ends each one if
the process dies without that).

A parked server still holds its memory, so keep servers warm only where this process is
the accelerator's only user (the demo, a run on a workstation): another run's step would
find the device taken. On a GPU the parked servers stop before another server starts.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class Parkable(Protocol):
    def stop(self) -> None: ...


_lock = threading.Lock()
_parked: list[tuple[str, Parkable]] = []  # oldest first
_registered = False


def key(model: str, serve_args: Sequence[str], *rest: Any) -> str:
    """What a parked server must match to serve a step: the target, serve arguments and
    `rest` (interpreter, key rule, engine options), and the files it loaded. Not its
    image directory: an image outside it travels inside its request (`media_urls`)."""
    return json.dumps([model, list(serve_args), *rest, served_files(model, serve_args)])


def served_files(model: str, serve_args: Sequence[str]) -> list[tuple[str, int, int]]:
    """Name, size and mtime of each file in the directories served from (the target, a
    draft named by a JSON argument's `model`): a server loaded them when it started, so
    one whose files were rewritten since (a retrained draft at the same path) is not
    taken."""
    dirs = [Path(model)]
    for arg in serve_args:
        with contextlib.suppress(ValueError, TypeError, KeyError):
            dirs.append(Path(json.loads(arg)["model"]))
    stamp = []
    for d in dirs:
        with contextlib.suppress(OSError):  # a hub id, not a directory
            for f in sorted(d.iterdir()):
                if f.is_file():
                    stamp.append((str(f), (s := f.stat()).st_size, s.st_mtime_ns))
    return stamp


def take(key: str) -> Parkable | None:
    """The latest server parked under `key`, no longer parked; None when none is."""
    with _lock:
        for i in range(len(_parked) - 1, -1, -1):
            if _parked[i][0] == key:
                return _parked.pop(i)[1]
    return None


def park(key: str, server: Parkable, limit: int) -> None:
    """Keep `server` for a later `take(key)`; the servers parked longest ago beyond
    `limit` are stopped."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(stop_all)
            _registered = True
        _parked.append((key, server))
        evicted = [s for _, s in _parked[: max(len(_parked) - limit, 0)]]
        del _parked[: len(evicted)]
    for stale in evicted:
        stale.stop()


def parked() -> list[Parkable]:
    """The servers parked now, oldest first."""
    with _lock:
        return [s for _, s in _parked]


def stop_all() -> None:
    """Stop every parked server (at exit, and for a caller that needs the memory)."""
    with _lock:
        servers = [s for _, s in _parked]
        _parked.clear()
    for server in servers:
        server.stop()
