"""Drafts judged the way the field does, per category of their benchmarks, in vLLM,
against no speculation and n-gram: `speculator_benchmark` for a dataset's own draft,
`draft_benchmark` for a draft of several datasets (on its sources' benchmarks). Two
assets only because Dagster runs one partitioning per run; one body."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field

from mm_assets.assets.config import config_class, stage_settings
from mm_assets.assets.drafts import trained_draft
from mm_assets.assets.metadata import benchmark_plot, rounded, table_links
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
from mm_assets.domain.model.acceptance import OVERALL
from mm_assets.domain.model.benchmark import BENCHMARK_VERSION, BenchmarkSettings
from mm_assets.services.media import media_root
from mm_assets.storage.layout import StorageLayout, has_weights

if TYPE_CHECKING:
    from mm_assets.services.benchmarking import BenchmarkReport
    from mm_assets.services.engine import DraftUnderTest

BenchmarkConfig = config_class(
    "BenchmarkConfig",
    "speculator_benchmark",
    BenchmarkSettings,
    remeasure=(
        bool,
        Field(False, description="Serve and measure again even when nothing changed."),
    ),
)
TABLE = "speculator_benchmarks"
METHOD_NAMES = {"eagle3": "draft (EAGLE-3)", "ngram": "n-gram", "none": "no speculation"}


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
    outputs equal those without speculation — all from vLLM's own counters, differenced
    per category. Rows go to the `speculator_benchmarks` table, kept across drafts and
    retrainings. An unchanged draft and benchmark send nothing."""
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
        reused = reused and was_reused
        metadata |= benchmark_metadata(name, report)
    metadata |= table_links(tables, TABLE, spec.name)
    metadata |= {"rows_written": rows_written, "reused": reused}
    return dg.MaterializeResult(metadata=rounded(metadata))


def table_rows(
    name: str,
    bench: str,
    report: BenchmarkReport,
    settings: BenchmarkSettings,
    target_fingerprint: str,
    draft: DraftUnderTest,
) -> list[dict[str, Any]]:
    """The report as rows of `speculator_benchmarks`; a method vLLM did not run gets one
    row saying why (its columns stay, empty)."""
    from mm_assets.domain.model.benchmark import speedup

    common = {
        "draft": name,
        "benchmark": bench,
        "max_tokens": settings.max_tokens,
        "concurrency": settings.concurrency,
        "target_fingerprint": target_fingerprint,
        "draft_sha256": draft.weights_sha256,
        "measured_at": datetime.now(UTC),
    }
    rows = [
        {
            **common,
            "category": f.category,
            "method": f.method,
            "status": "ok",
            "prompts": f.prompts,
            "requests": f.requests,
            "output_tokens": f.output_tokens,
            "acceptance_length": f.acceptance_length,
            "per_position_acceptance": f.per_position,
            "drafts": f.drafts,
            "output_tokens_per_s": f.tokens_per_s,
            "time_per_output_token_ms": f.mean_time_per_output_token_ms,
            "speedup": speedup(f, report.rows),
            "lossless": f.lossless,
            "compared": f.compared,
        }
        for f in report.rows
    ]
    for method, why in report.not_run.items():
        rows.append({**common, "category": OVERALL, "method": method, "status": why[:500]})
    return rows


RESULT_COLUMNS = [
    dg.TableColumn("category", "string"),
    dg.TableColumn("method", "string"),
    dg.TableColumn("acceptance length", "float"),
    dg.TableColumn("per position", "string"),
    dg.TableColumn("tokens/s", "float"),
    dg.TableColumn("ms/token", "float"),
    dg.TableColumn("speedup", "float"),
    dg.TableColumn("lossless", "string"),
    dg.TableColumn("note", "string"),
]


def benchmark_metadata(bench: str, report: BenchmarkReport) -> dict[str, Any]:
    """Per benchmark: a table category × method (Dagster's own table), a bar plot, and the
    overall figures as numbers (the Plots tab follows them across materializations).
    Keys stay short: the UI's key column is narrow."""
    from mm_assets.domain.model.benchmark import speedup

    empty = dict.fromkeys(c.name for c in RESULT_COLUMNS)  # Dagster wants every field
    records = []
    for f in report.rows:
        ratio = speedup(f, report.rows)
        cells = {
            "category": f.category,
            "method": METHOD_NAMES.get(f.method, f.method),
            "acceptance length": _round(f.acceptance_length),
            "per position": ", ".join(f"{p:.2f}" for p in f.per_position) or "-",
            "tokens/s": _round(f.tokens_per_s, 1),
            "ms/token": _round(f.mean_time_per_output_token_ms, 1),
            "speedup": _round(ratio, 2),
            "lossless": f"{f.lossless}/{f.compared}" if f.lossless is not None else "reference",
        }
        records.append(dg.TableRecord({**empty, **cells}))
    for method, why in report.not_run.items():
        cells = {"category": "all", "method": METHOD_NAMES.get(method, method), "note": why[:200]}
        records.append(dg.TableRecord({**empty, **cells}))
    out: dict[str, Any] = {
        bench: dg.MetadataValue.table(records, schema=dg.TableSchema(columns=RESULT_COLUMNS)),
        f"{bench} plot": benchmark_plot(bench, report.rows),
    }
    for f in report.rows:
        if f.category != OVERALL:
            continue
        if f.acceptance_length is not None:
            out[f"{bench} {f.method} acceptance"] = f.acceptance_length
        if (ratio := speedup(f, report.rows)) is not None and f.method != "none":
            out[f"{bench} {f.method} speedup"] = ratio
        out[f"{bench} {f.method} tokens/s"] = f.tokens_per_s
    return out


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
