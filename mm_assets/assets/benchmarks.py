"""`speculator_benchmark`: a dataset's draft judged the way the field does, per category of
the benchmarks its registry entry lists, in vLLM, against no speculation and n-gram."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field

from mm_assets.assets.config import config_class, stage_settings
from mm_assets.assets.media import media_root
from mm_assets.assets.metadata import benchmark_plot, rounded, table_links
from mm_assets.assets.model import trained_speculator
from mm_assets.assets.partitions import (
    REGISTRY,
    accelerator_asset,
    benchmarks_of_datasets,
    dataset_spec,
)
from mm_assets.assets.prep import normalized_conversations
from mm_assets.assets.resources import StorageResource, TargetModelResource, VllmResource
from mm_assets.domain.model.acceptance import OVERALL
from mm_assets.domain.model.benchmark import BENCHMARK_VERSION, BenchmarkSettings
from mm_assets.domain.model.settings import SpeculatorSettings

if TYPE_CHECKING:
    from mm_assets.services.benchmarking import BenchmarkReport

BenchmarkConfig = config_class(
    "BenchmarkConfig",
    "speculator_benchmark",
    BenchmarkSettings,
    remeasure=(
        bool,
        Field(False, description="Serve and measure again even when nothing changed."),
    ),
)
METHOD_NAMES = {"eagle3": "draft (EAGLE-3)", "ngram": "n-gram", "none": "no speculation"}


@accelerator_asset(
    BENCHMARK_VERSION,
    deps=[
        trained_speculator,
        dg.AssetDep(normalized_conversations, partition_mapping=benchmarks_of_datasets()),
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
    from mm_assets.common.hashing import file_sha256
    from mm_assets.services.benchmark_sets import load_benchmark, results_key, write_results
    from mm_assets.services.benchmarking import benchmark
    from mm_assets.services.engine import DraftUnderTest

    spec, tables, root = dataset_spec(context), storage.tables(), Path(storage.root)
    settings = stage_settings(context, spec, "speculator_benchmark", BenchmarkSettings)
    if not spec.benchmarks:
        return dg.MaterializeResult(
            metadata={"benchmarks": "none: list some under the entry's `benchmarks:`"}
        )
    draft_dir = root / "speculators" / spec.name
    weights = draft_dir / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(
            f"no draft at {draft_dir}: materialize trained_speculator for {spec.name} first"
        )
    target = target_model.model()
    tokens = stage_settings(context, spec, "trained_speculator", SpeculatorSettings)
    draft = DraftUnderTest(draft_dir, file_sha256(weights), tokens.speculative_tokens)
    fingerprint = target.fingerprint
    metadata: dict[str, Any] = {}
    rows_written = 0
    for name in spec.benchmarks:
        prompts = load_benchmark(tables, name, settings.max_prompts_per_category)
        log = storage.log_path(f"vllm_bench_{name}_{context.run.run_id}")
        serving = vllm.serving(target.local_dir, media_root(REGISTRY[name], tables, root), log)
        records = root / "benchmarks" / "records"
        report = benchmark(
            serving, prompts.categories, draft, settings, records, reuse=not config.remeasure
        )
        rows = table_rows(spec.name, name, report, settings, fingerprint, draft.weights_sha256)
        key = results_key(draft.weights_sha256, name, settings.model_dump())
        reused = all(report.reused.values())
        rows_written += write_results(tables, spec.name, key, rows, reused)
        metadata |= benchmark_metadata(name, report)
    tables.add_to_catalog(["speculator_benchmarks"])
    metadata |= table_links(tables, "speculator_benchmarks", spec.name)
    metadata["rows_written"] = rows_written
    return dg.MaterializeResult(metadata=rounded(metadata))


def table_rows(
    draft: str,
    bench: str,
    report: BenchmarkReport,
    settings: BenchmarkSettings,
    target_fingerprint: str,
    draft_sha256: str,
) -> list[dict[str, Any]]:
    """The report as rows of `speculator_benchmarks`; a method vLLM did not run gets one
    row saying why (its columns stay, empty)."""
    from mm_assets.domain.model.benchmark import speedup

    now = datetime.now(UTC)
    common = {
        "draft": draft, "benchmark": bench, "max_tokens": settings.max_tokens,
        "concurrency": settings.concurrency, "target_fingerprint": target_fingerprint,
        "draft_sha256": draft_sha256, "measured_at": now,
    }  # fmt: skip
    rows = []
    for f in report.rows:
        rows.append(
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
        )
    for method, why in report.not_run.items():
        rows.append({**common, "category": OVERALL, "method": method, "status": why[:500]})
    return rows


def benchmark_metadata(bench: str, report: BenchmarkReport) -> dict[str, Any]:
    """A Markdown table category × method, a bar plot, and the overall figures as numbers
    (the Plots tab follows them across materializations)."""
    from mm_assets.domain.model.benchmark import speedup

    lines = [
        "| category | method | acceptance length | per position | tokens/s | ms/token "
        "| speedup | lossless |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for f in report.rows:
        accepted = f"{f.acceptance_length:.3f}" if f.acceptance_length is not None else "-"
        positions = ", ".join(f"{p:.2f}" for p in f.per_position) or "-"
        ratio = speedup(f, report.rows)
        lossless = f"{f.lossless}/{f.compared}" if f.lossless is not None else "(reference)"
        category = f"**{f.category}**" if f.category == OVERALL else f.category
        lines.append(
            f"| {category} | {METHOD_NAMES.get(f.method, f.method)} | {accepted} | {positions} "
            f"| {f.tokens_per_s:.1f} | {f.mean_time_per_output_token_ms:.1f} "
            f"| {'-' if ratio is None else f'{ratio:.2f}x'} | {lossless} |"
        )
    for method, why in report.not_run.items():
        lines.append(f"| all | {METHOD_NAMES.get(method, method)} | not run: {why[:200]} |")
    out: dict[str, Any] = {
        f"benchmark_{bench}": dg.MetadataValue.md("\n".join(lines)),
        f"benchmark_{bench}_plot": benchmark_plot(bench, report.rows),
        f"benchmark_{bench}_reused": all(report.reused.values()),
    }
    for f in report.rows:
        if f.category != OVERALL:
            continue
        if f.acceptance_length is not None:
            out[f"benchmark_{bench}_acceptance_length_{f.method}"] = f.acceptance_length
        if (ratio := speedup(f, report.rows)) is not None and f.method != "none":
            out[f"benchmark_{bench}_speedup_{f.method}"] = ratio
        out[f"benchmark_{bench}_tokens_per_s_{f.method}"] = f.tokens_per_s
        if f.lossless is not None:
            out[f"benchmark_{bench}_lossless_{f.method}"] = f"{f.lossless}/{f.compared}"
    return out
