"""The files vLLM's hidden-states connector writes: one safetensors file per request,
with a `.lock` file beside it that the connector holds (exclusively) while writing."""

from __future__ import annotations

import fcntl
import time
from pathlib import Path


def wait_for_writer(path: Path, timeout_s: float) -> None:
    """Block until the connector released its exclusive lock on `<path>.lock` (or, with
    no lock file, until the file exists)."""
    lock = Path(f"{path}.lock")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(lock) as fh:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
        except FileNotFoundError:
            if path.is_file():
                break
        except BlockingIOError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} still locked by the writer after {timeout_s:.0f}s")
        time.sleep(0.01)


def discard(path: Path) -> None:
    """Remove a connector's file and its lock (read, rejected or moved away)."""
    path.unlink(missing_ok=True)
    Path(f"{path}.lock").unlink(missing_ok=True)
