"""What a benchmark report becomes: rows of `speculator_benchmarks` (figures and their
95% intervals), the requests behind them (`speculator_benchmark_prompts`), and the UI's
tables and plot (the draft against n-gram paired on the same prompts)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import dagster as dg

from mm_assets.assets.metadata import benchmark_plot
from mm_assets.domain.model.acceptance import OVERALL
from mm_assets.domain.model.benchmark import NONE, Method, comparison, method_of
from mm_assets.domain.model.settings import BenchmarkSettings

if TYPE_CHECKING:
    from mm_assets.domain.model.benchmark import BenchmarkFigures, BenchmarkReport
    from mm_assets.domain.model.intervals import Interval
    from mm_assets.services.engine import DraftUnderTest

TABLE = "speculator_benchmarks"
PROMPTS_TABLE = "speculator_benchmark_prompts"
METHOD_NAMES = {
    "eagle3": "draft (EAGLE-3)",
    "dflash": "draft (DFlash)",
    "peagle": "draft (P-EAGLE)",
    "ngram": "n-gram",
    "none": "no speculation",
}


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
    common = {
        "draft": name,
        "benchmark": bench,
        "max_tokens": settings.max_tokens,
        "concurrency": settings.concurrency,
        "target_fingerprint": target_fingerprint,
        "draft_sha256": draft.weights_sha256,
        "measured_at": datetime.now(UTC),
    }
    rows = [{**common, **_figures(f, report)} for f in report.rows]
    for run in report.runs.values():
        if run.not_run is not None:
            method = {"method": run.method, "speculative_tokens": run.depth}
            rows.append({**common, "category": OVERALL, **method, "status": run.not_run[:500]})
    return rows


def _figures(f: BenchmarkFigures, report: BenchmarkReport) -> dict[str, Any]:
    """One row's figures and their intervals' bounds."""
    found = report.row_intervals[(f.category, method_of(f))]
    bounds = {
        "acceptance": found.acceptance_length,
        "output_tokens_per_s": found.tokens_per_s,
        "speedup": found.speedup,
    }
    figures = {
        "category": f.category,
        "method": f.method,
        "speculative_tokens": f.depth,
        "status": "ok",
        "prompts": f.prompts,
        "requests": f.requests,
        "output_tokens": f.output_tokens,
        "acceptance_length": f.acceptance_length,
        "per_position_acceptance": f.per_position,
        "drafts": f.drafts,
        "output_tokens_per_s": f.tokens_per_s,
        "time_per_output_token_ms": f.mean_time_per_output_token_ms,
        "speedup": report.speedup(f),
        "lossless": f.lossless,
        "compared": f.compared,
    }
    for name, interval in bounds.items():
        figures[f"{name}_low"] = interval.low if interval else None
        figures[f"{name}_high"] = interval.high if interval else None
    return figures


def prompt_rows(name: str, bench: str, report: BenchmarkReport) -> list[dict[str, Any]]:
    """The requests behind the report's rows (`speculator_benchmark_prompts`)."""
    measured_at = datetime.now(UTC)
    return [
        {
            "draft": name,
            "benchmark": bench,
            "category": r.category,
            "method": r.method,
            "conversation": r.conversation,
            "round": r.round,
            "output_tokens": r.output_tokens,
            "latency_s": r.latency_s,
            "decode_s": r.decode_s,
            "drafts": r.acceptance.drafts,
            "accepted": r.acceptance.accepted,
            "accepted_per_position": list(r.acceptance.accepted_per_position),
            "lossless": r.lossless,
            "speculative_tokens": r.depth,
            "beside": r.beside,
            "measured_at": measured_at,
        }
        for r in report.records
    ]


RESULT_COLUMNS = [
    dg.TableColumn("category", "string"),
    dg.TableColumn("method", "string"),
    dg.TableColumn("prompts", "int"),
    dg.TableColumn("acceptance length", "float"),
    dg.TableColumn("acceptance 95% CI", "string"),
    dg.TableColumn("per position", "string"),
    dg.TableColumn("tokens/s", "float"),
    dg.TableColumn("ms/token", "float"),
    dg.TableColumn("speedup", "float"),
    dg.TableColumn("speedup 95% CI", "string"),
    dg.TableColumn("lossless", "string"),
    dg.TableColumn("note", "string"),
]
VERSUS_COLUMNS = [
    dg.TableColumn("category", "string"),
    dg.TableColumn("prompts", "int"),
    dg.TableColumn("acceptance ratio", "float"),
    dg.TableColumn("acceptance 95% CI", "string"),
    dg.TableColumn("tokens/s ratio", "float"),
    dg.TableColumn("tokens/s 95% CI", "string"),
]


def _ci(interval: Interval | None, digits: int = 3) -> str:
    return f"[{interval.low:.{digits}f}, {interval.high:.{digits}f}]" if interval else "-"


def versus_table(
    report: BenchmarkReport, methods: tuple[Method, Method]
) -> dg.MetadataValue | None:
    """`methods[0]` against `methods[1]` per category on the same prompts: the ratio of
    their acceptance lengths and of their tokens/s, each with a paired 95% interval."""
    categories = list(dict.fromkeys(f.category for f in report.rows))
    records = []
    for category in categories:
        accept = comparison(report.records, methods, category, "acceptance_length")
        speed = comparison(report.records, methods, category, "tokens_per_s")
        if speed is None:
            continue
        cells = {
            "category": category,
            "prompts": speed.n,
            "acceptance ratio": _round(accept and accept.value),
            "acceptance 95% CI": _ci(accept),
            "tokens/s ratio": _round(speed.value),
            "tokens/s 95% CI": _ci(speed),
        }
        records.append(dg.TableRecord(cells))
    if not records:
        return None
    return dg.MetadataValue.table(records, schema=dg.TableSchema(columns=VERSUS_COLUMNS))


def benchmark_metadata(bench: str, report: BenchmarkReport) -> dict[str, Any]:
    """Per benchmark: a table category × method at the draft's depth (Dagster's own
    table), a bar plot, the draft against n-gram, each depth when several, and the
    overall figures as numbers. Keys stay short: the UI's key column is narrow."""
    empty = dict.fromkeys(c.name for c in RESULT_COLUMNS)  # Dagster wants every field
    records = []
    shown = report.shown  # at the draft's depth; every depth: `by depth`
    for f in shown:
        ratio = report.speedup(f)
        found = report.row_intervals[(f.category, method_of(f))]
        cells = {
            "category": f.category,
            "method": METHOD_NAMES.get(f.method, f.method),
            "prompts": f.prompts,
            "acceptance length": _round(f.acceptance_length),
            "acceptance 95% CI": _ci(found.acceptance_length),
            "per position": ", ".join(f"{p:.2f}" for p in f.per_position) or "-",
            "tokens/s": _round(f.tokens_per_s, 1),
            "ms/token": _round(f.mean_time_per_output_token_ms, 1),
            "speedup": _round(ratio, 2),
            "speedup 95% CI": _ci(found.speedup, 2),
            "lossless": f"{f.lossless}/{f.compared}" if f.lossless is not None else "reference",
        }
        records.append(dg.TableRecord({**empty, **cells}))
    for label, why in report.not_run.items():
        cells = {"category": "all", "method": label, "note": why[:200]}
        records.append(dg.TableRecord({**empty, **cells}))
    out: dict[str, Any] = {
        bench: dg.MetadataValue.table(records, schema=dg.TableSchema(columns=RESULT_COLUMNS)),
        f"{bench} plot": benchmark_plot(bench, shown, report.speedup),
    }
    draft, depth = report.draft_method, report.depth
    versus = draft and versus_table(report, ((draft, depth), ("ngram", depth)))
    if versus is not None:
        out[f"{bench} draft vs n-gram"] = versus
    if len({f.depth for f in report.rows} - {None}) > 1:
        out[f"{bench} by depth"] = depth_table(report)
    return out | overall_numbers(bench, report)


def overall_numbers(bench: str, report: BenchmarkReport) -> dict[str, float]:
    """The overall figures as numbers: the Plots tab follows them across runs."""
    out = {}
    for f in report.shown:
        if f.category != OVERALL:
            continue
        if f.acceptance_length is not None:
            out[f"{bench} {f.method} acceptance"] = f.acceptance_length
        if (ratio := report.speedup(f)) is not None and f.method != "none":
            out[f"{bench} {f.method} speedup"] = ratio
        out[f"{bench} {f.method} tokens/s"] = f.tokens_per_s
    return out


DEPTH_COLUMNS = [
    dg.TableColumn("method", "string"),
    dg.TableColumn("tokens", "int"),
    dg.TableColumn("acceptance length", "float"),
    dg.TableColumn("acceptance 95% CI", "string"),
    dg.TableColumn("speedup", "float"),
    dg.TableColumn("speedup 95% CI", "string"),
]


def depth_table(report: BenchmarkReport) -> dg.MetadataValue:
    """Over every category, each speculating method at each depth: acceptance length and
    speedup over no speculation (paired), with 95% intervals: where speculation pays."""
    records = []
    for f in report.rows:
        if f.category != OVERALL or method_of(f) == NONE:
            continue
        found = report.row_intervals[(OVERALL, method_of(f))]
        cells = {
            "method": METHOD_NAMES.get(f.method, f.method),
            "tokens": f.depth,
            "acceptance length": _round(f.acceptance_length),
            "acceptance 95% CI": _ci(found.acceptance_length),
            "speedup": _round(found.speedup and found.speedup.value, 2),
            "speedup 95% CI": _ci(found.speedup, 2),
        }
        records.append(dg.TableRecord(cells))
    return dg.MetadataValue.table(records, schema=dg.TableSchema(columns=DEPTH_COLUMNS))


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
