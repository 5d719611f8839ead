"""One partition per registered dataset, and the decorator every asset here uses."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import dagster as dg

from mm_assets.assets.automation import materialize_on_change
from mm_assets.assets.config import STAGE_SETTINGS
from mm_assets.assets.executors import accelerator_step_tags
from mm_assets.orchestration.wiring import WATCH_KEY, taking_watch, watch_resource
from mm_assets.registry import DatasetSpec, DraftSpec, load_drafts, load_registry

# Steps that hold the accelerator (a vLLM server, training) share one pool; its limit is
# the instance's `concurrency.pools` setting (dagster.yaml: one at a time by default).
ACCELERATOR_POOL = "accelerator"
# One watch (mm_assets/orchestration/) for all the accelerator assets: Dagster requires a
# resource key to mean the same object everywhere.
ACCELERATOR_WATCH = watch_resource([ACCELERATOR_POOL])

REGISTRY = load_registry(STAGE_SETTINGS)
dataset_partitions = dg.StaticPartitionsDefinition(sorted(REGISTRY))
# Drafts of several datasets (`trained_draft`); each dataset's own is `trained_speculator`.
# Their own partitions: Dagster runs one partitions definition per run, so a dataset's
# chain (`*trained_speculator`) stays one run.
DRAFTS = {n: d for n, d in load_drafts(REGISTRY, STAGE_SETTINGS).items() if not d.is_dataset}
draft_partitions = dg.StaticPartitionsDefinition(sorted(DRAFTS))


def dataset_spec(context: dg.AssetExecutionContext) -> DatasetSpec:
    return REGISTRY[context.partition_key]


def draft_spec(context: dg.AssetExecutionContext) -> DraftSpec:
    return DRAFTS[context.partition_key]


def _mapping(pairs: Iterable[tuple[str, str]]) -> dg.StaticPartitionMapping:
    """A static mapping from (upstream partition, downstream partition) pairs."""
    mapping: dict[str, list[str]] = {}
    for upstream, downstream in pairs:
        mapping.setdefault(upstream, []).append(downstream)
    return dg.StaticPartitionMapping(mapping)


def sources_of_drafts() -> dg.StaticPartitionMapping:
    """Each dataset partition to the drafts it is a source of."""
    return _mapping((s, name) for name, draft in sorted(DRAFTS.items()) for s in draft.sources)


def benchmarks_of_datasets() -> dg.StaticPartitionMapping:
    """Each benchmark partition to the datasets whose drafts are measured on it."""
    return _mapping((b, name) for name, spec in sorted(REGISTRY.items()) for b in spec.benchmarks)


def skipping_benchmarks(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, except on a benchmark's partition, where the step records that a benchmark
    is never trained on and passes its checks without doing anything. Benchmarks are
    partitions of every dataset asset because Dagster runs one partitioning per run: a
    benchmark's chain (ingest and prep) is then the same job as a dataset's."""

    @functools.wraps(fn)
    def step(context: dg.AssetExecutionContext, *args: Any, **kwargs: Any) -> Any:
        spec = REGISTRY.get(context.partition_key)
        if spec is None or not spec.is_benchmark:
            return fn(context, *args, **kwargs)
        why = f"{spec.name} is a benchmark (role: benchmark): prepared, never trained on."
        context.log.info("%s Nothing to do for %s.", why, context.assets_def.key.to_user_string())
        return dg.MaterializeResult(
            metadata={"benchmark": why},
            data_version=dg.DataVersion("benchmark"),
            check_results=[
                dg.AssetCheckResult(check_name=check.name, passed=True, description=why)
                for check in context.assets_def.check_specs
            ],
        )

    return step


def dataset_asset(
    group: str,
    code_version: str,
    deps: Sequence[Any] = (),
    kinds: set[str] | None = None,
    partitions_def: dg.PartitionsDefinition = dataset_partitions,
    trains: bool = False,
    **extra: Any,
) -> Callable[..., dg.AssetsDefinition]:
    """`@dg.asset` partitioned by dataset (or `partitions_def`); an asset with upstream
    assets materializes when they really change (`materialize_on_change`), the first one
    on request or by the refresh schedule. A step that `trains` (or feeds training) does
    nothing on a benchmark's partition (`skipping_benchmarks`)."""
    decorate = dg.asset(
        partitions_def=partitions_def,
        automation_condition=materialize_on_change() if deps else None,
        group_name=group,
        code_version=code_version,
        kinds=kinds or {"parquet"},
        deps=list(deps),
        **extra,
    )
    return (lambda fn: decorate(skipping_benchmarks(fn))) if trains else decorate


def accelerator_asset(
    code_version: str, deps: Sequence[Any], kinds: set[str], **extra: Any
) -> Callable[..., dg.AssetsDefinition]:
    """A `model` asset whose step holds the accelerator (a vLLM server, training). It takes
    the pool's watch as a resource, so that its runs free the slots dead runs hold, and
    tags that send it to GPU workers (`executors.py`). None runs on a benchmark's
    partition (`skipping_benchmarks`)."""

    def decorate(fn: Callable[..., Any]) -> dg.AssetsDefinition:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dg.BetaWarning)  # `resource_defs` of `dg.asset`
            return dataset_asset(
                "model",
                code_version,
                deps=deps,
                kinds=kinds,
                pool=ACCELERATOR_POOL,
                op_tags=accelerator_step_tags(),  # Celery queue, Kubernetes GPUs
                resource_defs={WATCH_KEY: ACCELERATOR_WATCH},
                trains=True,
                **extra,
            )(taking_watch(fn))

    return decorate
