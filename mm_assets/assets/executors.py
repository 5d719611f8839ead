"""Where a run's steps execute.

Default: in the run's own process, one step after another. The chain of a partition is
linear, so nothing runs in parallel anyway, and each library (transformers for
tokenization, torch for training) is imported once per run, when a step first needs it.
Measured with `bench/cli_overhead.py` on the four prep stages: ~5 s of fixed cost per
CLI run, against ~20 s with a process per step forked from a server that preloads the
step code, and ~12 s with the fork server preloading nothing heavy.

`MM_ASSETS_EXECUTOR=multiprocess` gives each step its own process instead (forked from
that preloading server): a step's memory is then returned to the system when it ends,
which matters on a shared box where a long run holds a GPU between steps.

Either way the run's executor runs under a pool watch (`pool.py`): while a step waits for a
slot of its pool (the accelerator), slots held by runs whose worker died are freed.
"""

from __future__ import annotations

import os

import dagster as dg

from mm_assets.assets.pool import watch_pools_of

PRELOADED = ["mm_assets.definitions", "mm_assets.services.preload"]


def step_executor() -> dg.ExecutorDefinition:
    """The executor `MM_ASSETS_EXECUTOR` names: `in_process` (default) or `multiprocess`,
    under a watch that frees pool slots held by dead runs."""
    choice = os.environ.get("MM_ASSETS_EXECUTOR", "in_process")
    if choice == "in_process":
        return watch_pools_of(dg.in_process_executor)
    if choice == "multiprocess":
        return watch_pools_of(dg.multiprocess_executor).configured(
            {"start_method": {"forkserver": {"preload_modules": PRELOADED}}}
        )
    raise ValueError(f"MM_ASSETS_EXECUTOR={choice!r}: use in_process or multiprocess")
