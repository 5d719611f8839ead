"""Every use of Dagster that its public API does not cover, in one place.

The dead-run watch does what Dagster's daemon does (read a pool's queue, free a run's
slots, mark a run failed), tags a running run and reads an executor's plan: none of it
public in Dagster 1.13, so each use is one small function here. `tests/test_dagster_internals.py`
drives every one against a real instance and pins the minor version (`CHECKED_ON`): an
upgrade that changes them fails there instead of breaking accelerator steps at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

CHECKED_ON = "1.13"


@dataclass(frozen=True)
class PoolQueue:
    """Who holds a pool's slots and who waits for one, as (run id, step key) pairs."""

    holding: tuple[tuple[str, str], ...]  # claimed, or assigned and about to be claimed
    waiting: tuple[tuple[str, str], ...]


def supports_pools(instance: dg.DagsterInstance) -> bool:
    """Whether the instance's storage keeps pool slots (SQLite and Postgres storages do)."""
    return bool(instance.event_log_storage.supports_global_concurrency_limits)


def pool_queue(instance: dg.DagsterInstance, pool: str) -> PoolQueue:
    info = instance.event_log_storage.get_concurrency_info(pool)
    # A claimed step is also listed as pending, with the time its slot was assigned.
    holding = [(slot.run_id, slot.step_key) for slot in info.claimed_slots]
    holding += [(p.run_id, p.step_key) for p in info.pending_steps if p.assigned_timestamp]
    waiting = [(p.run_id, p.step_key) for p in info.pending_steps if not p.assigned_timestamp]
    return PoolQueue(tuple(dict.fromkeys(holding)), tuple(waiting))


def free_slots_of_run(instance: dg.DagsterInstance, run_id: str) -> None:
    """What the UI's "Free concurrency slots" and run monitoring do."""
    instance.event_log_storage.free_concurrency_slots_for_run(run_id)


def mark_run_failed(instance: dg.DagsterInstance, run: dg.DagsterRun, message: str) -> None:
    """What run monitoring does to a run whose worker died: a run failure event."""
    instance.report_run_failed(run, message)


def tag_run(instance: dg.DagsterInstance, run_id: str, tags: dict[str, str]) -> None:
    """Add (or replace) tags of an existing run; read them back with `run.tags`."""
    instance.add_run_tags(run_id, tags)


def run_of_plan(
    plan_context: Any, execution_plan: Any
) -> tuple[dg.DagsterInstance, dg.DagsterRun, set[str], Any]:
    """The instance, run, pools of the steps to run and run logger of an executor's `execute`."""
    steps = execution_plan.get_steps_to_execute_in_topo_order()
    pools = {step.pool for step in steps if step.pool}
    return plan_context.instance, plan_context.dagster_run, pools, plan_context.log


def executor_requirements(executor_def: dg.ExecutorDefinition) -> Callable[..., Sequence[Any]]:
    """The requirement check of `executor_def`, for a definition built from it."""
    return executor_def.get_requirements
