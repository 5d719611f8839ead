"""One partition per registered dataset, and the decorator every asset here uses."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import dagster as dg

from mm_assets.assets.automation import materialize_on_change
from mm_assets.assets.executors import accelerator_step_tags
from mm_assets.orchestration.wiring import WATCH_KEY, taking_watch, watch_resource
from mm_assets.registry import DatasetSpec, DraftSpec
from mm_assets.services import settings

# Steps that hold the accelerator share one pool (its limit: dagster.yaml's
# `concurrency.pools`), and one watch: Dagster requires a resource key to mean one object.
ACCELERATOR_POOL = "accelerator"
ACCELERATOR_WATCH = watch_resource([ACCELERATOR_POOL])

REGISTRY = settings.datasets()
dataset_partitions = dg.StaticPartitionsDefinition(sorted(REGISTRY))
# Drafts of several datasets (`trained_draft`); each dataset's own is `trained_speculator`.
# Their own partitions: Dagster runs one partitions definition per run, so a dataset's
# chain (`*trained_speculator`) stays one run.
ALL_DRAFTS = settings.drafts(REGISTRY)
DRAFTS = {n: d for n, d in ALL_DRAFTS.items() if not d.is_dataset}
DATASET_DRAFTS = {n: d for n, d in ALL_DRAFTS.items() if d.is_dataset}
draft_partitions = dg.StaticPartitionsDefinition(sorted(DRAFTS))


def dataset_spec(context: dg.AssetExecutionContext) -> DatasetSpec:
    return REGISTRY[context.partition_key]


def draft_spec(context: dg.AssetExecutionContext) -> DraftSpec:
    """The draft of this partition: a draft entry's, or a dataset's own (one source)."""
    return ALL_DRAFTS[context.partition_key]


def _mapping(pairs: Iterable[tuple[str, str]]) -> dg.StaticPartitionMapping:
    mapping: dict[str, list[str]] = {}
    for upstream, downstream in pairs:
        mapping.setdefault(upstream, []).append(downstream)
    return dg.StaticPartitionMapping(mapping)


def sources_of_drafts() -> dg.StaticPartitionMapping:
    """Each dataset partition to the drafts it is a source of."""
    return _mapping((s, name) for name, draft in sorted(DRAFTS.items()) for s in draft.sources)


def benchmarks_of(drafts: Mapping[str, DraftSpec]) -> dg.StaticPartitionMapping:
    """Each benchmark partition to the drafts (of `drafts`) measured on it."""
    return _mapping((b, name) for name, draft in sorted(drafts.items()) for b in draft.benchmarks)


def benchmark_reason(context: dg.AssetExecutionContext) -> str | None:
    """Why a training stage does nothing on this partition, or None: benchmarks are
    partitions of every dataset asset because Dagster runs one partitioning per run (a
    benchmark's ingest and prep are then the same job as a dataset's)."""
    spec = REGISTRY.get(context.partition_key)
    if spec is None or not spec.is_benchmark:
        return None
    return f"{spec.name} is a benchmark (role: benchmark): prepared, never trained on."


def _skipping_benchmarks(fn: Callable[..., dg.MaterializeResult]) -> Callable[..., Any]:
    """`fn` as a step that may materialize nothing: on a benchmark's partition it records
    an observation saying why and yields no output, so the partition stays unmaterialized
    and Dagster skips the steps below it in the run."""

    @functools.wraps(fn)
    def step(context: dg.AssetExecutionContext, *args: Any, **kwargs: Any) -> Iterator[Any]:
        why = benchmark_reason(context)
        if why is not None:
            context.log.info("%s Nothing to do for %s.", why, context.asset_key.to_user_string())
            context.log_event(
                dg.AssetObservation(
                    context.asset_key, partition=context.partition_key, metadata={"benchmark": why}
                )
            )
            return
        result = fn(context, *args, **kwargs)
        # this asset's checks selected to run: all of them unless run alone
        selected = {key.name for key in context.selected_asset_check_keys}
        checks = [c for c in result.check_results or () if c.check_name in selected]
        yield dg.MaterializeResult(
            metadata=result.metadata, data_version=result.data_version, check_results=checks
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
    """`@dg.asset` partitioned by dataset (or `partitions_def`); `extra` (`check_specs`,
    `pool`, ...) goes to Dagster's decorator. An asset with upstream assets materializes
    when they really change (`materialize_on_change`), the first one on request or by the
    refresh schedule. A step that `trains` (or feeds training) materializes nothing on a
    benchmark's partition (`_skipping_benchmarks`): it is then a one-asset `multi_asset`
    whose output and checks are optional, the only way Dagster lets a step end without
    them."""
    spec_args: dict[str, Any] = dict(
        group_name=group,
        code_version=code_version,
        kinds=kinds or {"parquet"},
        deps=list(deps),
        automation_condition=materialize_on_change() if deps else None,
    )
    if not trains:
        return dg.asset(partitions_def=partitions_def, **spec_args, **extra)

    def decorate(fn: Callable[..., dg.MaterializeResult]) -> dg.AssetsDefinition:
        spec = dg.AssetSpec(fn.__name__, skippable=True, **spec_args)
        return dg.multi_asset(
            name=fn.__name__, specs=[spec], can_subset=True, partitions_def=partitions_def, **extra
        )(_skipping_benchmarks(fn))

    return decorate


def accelerator_asset(
    code_version: str, deps: Sequence[Any], kinds: set[str], **extra: Any
) -> Callable[..., dg.AssetsDefinition]:
    """A `model` asset whose step holds the accelerator (a vLLM server, training). It takes
    the pool's watch as a resource, so that its runs free the slots dead runs hold, and
    tags that send it to GPU workers (`executors.py`). None materializes on a benchmark's
    partition."""

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
