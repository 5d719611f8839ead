"""How every run with a step in a pool gets the dead-run watch (`dead_runs.py`).

Two ways in, because no single public Dagster mechanism reaches every run's worker while
its steps wait for a slot (checked in Dagster 1.13: hooks run after a step; run status
sensors and run monitoring need the daemon; loggers see no instance):
- the code location's executor (`watch_pools_of`): `dagster asset materialize`, `dg
  launch`, `dagster dev` and the daemon run it in the run worker, where the multiprocess,
  Celery and Kubernetes executors wait for slots before any step process exists;
- a resource every asset in a pool takes (`watch_resource`, `taking_watch`): `dg.materialize`
  and `execute_in_process` (the demo) run Dagster's in-process executor, never the code
  location's, and set resources up when the run starts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import dagster as dg

from mm_assets.orchestration import dagster_internals as internals
from mm_assets.orchestration.dead_runs import watching

WATCH_KEY = "pool_watch"


def watch_pools_of(executor_def: dg.ExecutorDefinition) -> dg.ExecutorDefinition:
    """`executor_def` whose executors run under a pool watch (configure it afterwards).
    The executor made is the inner one itself, its `execute` wrapped: whatever an
    executor's loop reads from `plan_context.executor` (Celery's `app_args`, retries)
    stays its own."""
    create = executor_def.executor_creation_fn
    if create is None:
        raise ValueError(f"executor {executor_def.name} has no creation function to watch")

    def create_watching(init_context: dg.InitExecutorContext) -> dg.Executor:
        executor = create(init_context)
        execute = executor.execute

        def execute_watched(plan_context: Any, execution_plan: Any) -> Iterator[Any]:
            with watching(*internals.run_of_plan(plan_context, execution_plan)):
                yield from execute(plan_context, execution_plan)

        executor.execute = execute_watched  # type: ignore[method-assign]
        return executor

    create_watching.watches_pools = True  # type: ignore[attr-defined]
    return dg.ExecutorDefinition(
        name=executor_def.name,
        config_schema=executor_def.config_schema,
        requirements=internals.executor_requirements(executor_def),
        executor_creation_fn=create_watching,
        description=executor_def.description,
    )


def is_watched(executor_def: dg.ExecutorDefinition) -> bool:
    """Whether `executor_def` came from `watch_pools_of`."""
    return bool(getattr(executor_def.executor_creation_fn, "watches_pools", False))


def watch_resource(pools: Sequence[str]) -> dg.ResourceDefinition:
    """A resource that watches `pools` for as long as a run's resources live."""

    @dg.resource(description=f"Frees slots of pools {', '.join(pools)} held by dead runs.")
    def pool_watch(context: dg.InitResourceContext) -> Iterator[None]:
        with watching(context.instance, context.run, pools, context.log):
            yield None

    return pool_watch


def taking_watch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with one more argument, the watch resource (`WATCH_KEY`), which it drops.

    Dagster sets up the resources an asset's arguments name when its run starts, and (1.13)
    refuses `required_resource_keys` beside resource arguments: so the watch becomes an
    argument here, without every accelerator asset spelling it out. `fn`'s annotations are
    resolved here, in its own module: they must not be TYPE_CHECKING-only."""
    signature = inspect.signature(fn, eval_str=True)
    watch = inspect.Parameter(
        WATCH_KEY, inspect.Parameter.KEYWORD_ONLY, annotation=dg.ResourceParam[None]
    )

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop(WATCH_KEY, None)
        return fn(*args, **kwargs)

    step.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), watch]
    )
    return step
