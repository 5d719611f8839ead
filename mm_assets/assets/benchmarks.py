"""Drafts judged the way the field does, per category of their benchmarks, in vLLM,
against no speculation and n-gram: `speculator_benchmark` for a dataset's own draft,
`draft_benchmark` for a draft of several datasets (on its sources' benchmarks). Two
assets only because Dagster runs one partitioning per run; one body."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field

from mm_assets.assets.benchmark_tables import (
    PROMPTS_TABLE,
    TABLE,
    benchmark_metadata,
    prompt_rows,
    table_rows,
)
from mm_assets.assets.config import config_class, stage_settings
from mm_assets.assets.drafts import trained_draft
from mm_assets.assets.metadata import rounded, table_links
from mm_assets.assets.model import trained_speculator
from mm_assets.assets.partitions import (
    DATASET_DRAFTS,
    DRAFTS,
    REGISTRY,
    accelerator_asset,
    benchmarks_of,
    draft_partitions,
    draft_spec,
)
from mm_assets.assets.prep import normalized_conversations
from mm_assets.assets.resources import StorageResource, TargetModelResource, VllmResource
from mm_assets.domain.model.benchmark import BENCHMARK_VERSION
from mm_assets.domain.model.settings import BenchmarkSettings
from mm_assets.services.media import media_root
from mm_assets.storage.layout import StorageLayout, has_weights

if TYPE_CHECKING:
    pass

BenchmarkConfig = config_class(
    "BenchmarkConfig",
    "speculator_benchmark",
    BenchmarkSettings,
    remeasure=(
        bool,
        Field(False, description="Serve and measure again even when nothing changed."),
    ),
)


@accelerator_asset(
    BENCHMARK_VERSION,
    deps=[
        trained_speculator,
        dg.AssetDep(normalized_conversations, partition_mapping=benchmarks_of(DATASET_DRAFTS)),
    ],
    kinds={"vllm", "parquet"},
)
def speculator_benchmark(
    context: dg.AssetExecutionContext,
    config: BenchmarkConfig,  # type: ignore[valid-type]
    storage: StorageResource,
    target_model: TargetModelResource,
    vllm: VllmResource,
) -> dg.MaterializeResult:
    """The dataset's draft on each benchmark its entry lists (`benchmarks:`), per
    category: acceptance length and per-position rates, output tokens/s and time per
    output token with the draft, without speculation and with vLLM's n-gram prompt
    lookup (same prompts, same `max_tokens`, greedy), the speedups, and whether the
    outputs equal those without speculation — each summed from its requests, whose own
    counts vLLM's replies give, with a 95% bootstrap interval over the prompts. Rows go
    to `speculator_benchmarks` (the requests to `speculator_benchmark_prompts`), kept
    across drafts and retrainings. An unchanged draft and benchmark send nothing."""
    return benchmark_step(context, config, storage, target_model, vllm)


@accelerator_asset(
    BENCHMARK_VERSION,
    deps=[
        trained_draft,
        dg.AssetDep(normalized_conversations, partition_mapping=benchmarks_of(DRAFTS)),
    ],
    kinds={"vllm", "parquet"},
    partitions_def=draft_partitions,
)
def draft_benchmark(
    context: dg.AssetExecutionContext,
    config: BenchmarkConfig,  # type: ignore[valid-type]
    storage: StorageResource,
    target_model: TargetModelResource,
    vllm: VllmResource,
) -> dg.MaterializeResult:
    """A draft of several datasets on the benchmarks its sources list, as
    `speculator_benchmark` measures a dataset's draft (its entry's
    `speculator_benchmark: {...}` settings); rows in the same table, under its name."""
    return benchmark_step(context, config, storage, target_model, vllm)


def benchmark_step(
    context: dg.AssetExecutionContext,
    config: Any,
    storage: StorageResource,
    target_model: TargetModelResource,
    vllm: VllmResource,
) -> dg.MaterializeResult:
    """The partition's draft on each of its benchmarks; no- speculation and n-gram
    figures are recorded per target, benchmark and settings, so a second draft on the
    same benchmark starts only its own server."""
    from mm_assets.services.benchmarking import benchmark, load_benchmark, results_key
    from mm_assets.services.engine import DraftUnderTest
    from mm_assets.services.result_tables import write_results

    spec, tables, root = draft_spec(context), storage.tables(), storage.root_dir()
    step = context.asset_key.to_user_string()
    settings = stage_settings(context, spec, "speculator_benchmark", BenchmarkSettings, step)
    if not spec.benchmarks:
        return dg.MaterializeResult(
            metadata={"benchmarks": "none: list some under its sources' `benchmarks:`"}
        )
    draft_dir = StorageLayout(root).draft(spec.name)
    if not has_weights(draft_dir):
        trains = "trained_speculator" if spec.is_dataset else "trained_draft"
        raise FileNotFoundError(f"no draft at {draft_dir}: materialize {trains} for {spec.name}")
    draft, target = DraftUnderTest.at(draft_dir), target_model.model()
    metadata: dict[str, Any] = {}
    rows_written, reused = 0, True
    for name in spec.benchmarks:
        prompts = load_benchmark(tables, name, settings.max_prompts_per_category)
        log = storage.log_path(f"vllm_bench_{name}_{context.run.run_id}")
        serving = vllm.serving(target, media_root(REGISTRY[name], tables, root), log)
        records = StorageLayout(root).benchmark_records()
        report = benchmark(
            serving, prompts.categories, draft, settings, records, reuse=not config.remeasure
        )
        rows = table_rows(spec.name, name, report, settings, target.fingerprint, draft)
        key = results_key(draft.weights_sha256, name, settings.model_dump())
        was_reused = all(report.reused.values())
        rows_written += write_results(tables, TABLE, spec.name, key, rows, was_reused)
        requests = prompt_rows(spec.name, name, report)
        write_results(tables, PROMPTS_TABLE, spec.name, key, requests, was_reused)
        reused = reused and was_reused
        metadata |= benchmark_metadata(name, report)
    metadata |= table_links(tables, TABLE, spec.name)
    metadata |= {"rows_written": rows_written, "reused": reused}
    return dg.MaterializeResult(metadata=rounded(metadata))
