"""Which test starts which expensive process: `pytest -p tests.start_counter` with
`MM_ASSETS_START_COUNTS=<file.json>` writes, per test, the vLLM servers, Dagster run
subprocesses and browsers that appeared while it (or its fixtures' setup) ran.

A sampler polls the process table every 0.2 s; each of these lives for seconds at least,
so none is missed. It measures the suite (docs/testing.md); it asserts nothing.
"""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict

import psutil
import pytest

KINDS = {
    "vllm_server": ("vllm.entrypoints.openai.api_server",),
    "dagster_cli": ("bin/dagster ", "bin/dg "),  # materialize, launch, dev, definitions
    "browser": ("chromium", "headless_shell"),
    "celery_worker": ("celery",),
}
GUARD = "mm_assets.clients.parent_guard"  # runs beside a server, its command line in its own


def _kind(cmdline: list[str]) -> str | None:
    text = " ".join(cmdline)
    if GUARD in text:
        return None
    for kind, needles in KINDS.items():
        if any(n in text for n in needles):
            # a browser's helpers (renderer, zygote...) are one browser
            if kind == "browser" and "--type=" in text:
                return None
            return kind
    return None


class _Sampler:
    def __init__(self) -> None:
        self.current = "(collection)"
        self.seen: set[tuple[int, float]] = set()
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            for proc in psutil.process_iter(["pid", "create_time", "cmdline"]):
                key = (proc.info["pid"], proc.info["create_time"])
                if key in self.seen or not proc.info["cmdline"]:
                    continue
                self.seen.add(key)
                kind = _kind(proc.info["cmdline"])
                if kind:
                    self.counts[self.current][kind] += 1


_SAMPLER: _Sampler | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _SAMPLER
    if os.environ.get("MM_ASSETS_START_COUNTS"):
        _SAMPLER = _Sampler()
        _SAMPLER.seen = {(p.pid, p.create_time()) for p in psutil.process_iter()}
        _SAMPLER.thread.start()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if _SAMPLER is not None:
        _SAMPLER.current = item.nodeid
    return (yield)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SAMPLER is None:
        return
    _SAMPLER.stop.set()
    _SAMPLER.thread.join()
    counts = {test: dict(kinds) for test, kinds in _SAMPLER.counts.items()}
    with open(os.environ["MM_ASSETS_START_COUNTS"], "w") as out:
        json.dump(counts, out, indent=1, sort_keys=True)
