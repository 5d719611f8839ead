"""Progress lines for long loops, so a step's log shows it is alive and when it ends.
Callers pass their module logger's `info`: Dagster captures it (python_logs)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    """Logs `<what> done/total (rate/s, ETA)` at most every `every_s` seconds."""

    def __init__(
        self,
        log: Callable[[str], None],
        what: str,
        total: int | None = None,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log, self._what, self._total, self._every = log, what, total, every_s
        self._clock = clock
        self._started = self._last = clock()

    def update(self, done: int, detail: str = "") -> None:
        """Count `done` items so far; `detail` (e.g. a token rate) is appended."""
        now = self._clock()
        if now - self._last < self._every:
            return
        self._last = now
        elapsed = now - self._started
        rate = done / elapsed if elapsed > 0 else 0.0
        extra = f", {detail}" if detail else ""
        if self._total and rate > 0:
            eta = (self._total - done) / rate
            counted = f"{done:,}/{self._total:,} ({rate:,.1f}/s{extra}, ETA {eta:,.0f}s)"
        else:
            counted = f"{done:,} ({rate:,.1f}/s{extra})"
        self._log(f"{self._what} {counted}")
