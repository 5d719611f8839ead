"""Formatters for the metadata a user reads in the Dagster UI: Markdown tables, and plots
as PNG images inside Markdown (the UI renders Markdown images; there is no plot type)."""

from __future__ import annotations

import base64
import io
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import dagster as dg
import numpy as np

from mm_assets.domain.model.settings import OnlineSettings
from mm_assets.storage import TableStore

if TYPE_CHECKING:  # matplotlib loads inside the steps that plot, not with the definitions
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mm_assets.domain.model.benchmark import BenchmarkFigures
    from mm_assets.domain.model.trainer import TrainResult
    from mm_assets.services.measurement import DraftMeasurements
    from mm_assets.services.online_batches import FetchReport
    from mm_assets.services.prep import StageReport
    from mm_assets.services.training import SpeculatorOutcome


def counts_table(counts: Mapping[str, int], key: str, value: str = "rows") -> dg.MetadataValue:
    """A Markdown table of counts, largest first."""
    lines = [f"| {key} | {value} |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in Counter(counts).most_common()] or ["| (none) | 0 |"]
    return dg.MetadataValue.md("\n".join(lines))


def servers_table(servers: Sequence[Mapping[str, object]], seconds: float) -> dg.MetadataValue:
    """Each vLLM server's share of a run (`VllmClient.server_stats`): what it answered,
    its failed tries, whether it was taken out of rotation, its tokens per second."""
    lines = [
        "| server | answered | failed tries | taken out | in rotation | tokens | tokens/s |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for s in servers:
        rate = float(s["tokens"]) / seconds if seconds else 0.0  # type: ignore[arg-type]
        lines.append(
            f"| {s['url']} | {s['answered']} | {s['failed_tries']} | {s['taken_out']} | "
            f"{'yes' if s['in_rotation'] else 'no'} | {s['tokens']} | {rate:,.0f} |"
        )
    return dg.MetadataValue.md("\n".join(lines))


def fetch_metadata(online: OnlineSettings, fetch: FetchReport | None) -> dict[str, object]:
    """Where training read its states; online, what fetching them took, pass by pass."""
    if online.hidden_states == "stored":
        return {"hidden_states_source": "stored"}
    out: dict[str, object] = {"hidden_states_source": f"online ({online.online_cache})"}
    if fetch is None:  # a reused checkpoint: nothing fetched
        return out
    lines = [
        "| pass | rows | fetched | tokens | stored already | rejected | trainer waited s "
        "| requests waited s | s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in fetch.passes:
        lines.append(
            f"| {p.label} | {p.rows} | {p.fetched} | {p.fetched_tokens} | {p.cache_hits} | "
            f"{sum(p.rejected.values())} | {p.trainer_wait_s:.1f} | {p.request_wait_s:.1f} | "
            f"{p.seconds:.1f} |"
        )
    requests, rejected = fetch.requests, Counter[str]()
    for p in fetch.passes:
        rejected.update(p.rejected)
    out |= {
        "online_passes": dg.MetadataValue.md("\n".join(lines)),
        "online_requests_sent": requests.requests_sent,
        "online_rows_fetched": sum(p.fetched for p in fetch.passes),
        "online_tokens_fetched": sum(p.fetched_tokens for p in fetch.passes),
        "online_cache_hits": sum(p.cache_hits for p in fetch.passes),
        "online_trainer_wait_s": sum(p.trainer_wait_s for p in fetch.passes),
        "online_request_wait_s": sum(p.request_wait_s for p in fetch.passes),
        "online_largest_batch_bytes": fetch.largest_batch_bytes,
        "online_servers": servers_table(requests.servers, requests.seconds or 0.0),
        "online_server_startup_s": requests.startup_s if requests.startup_s is not None else "n/a",
        **{f"online_rejected_{reason}": n for reason, n in rejected.items()},
    }
    if online.online_cache == "discard":
        out["online_disk_peak_bytes"] = fetch.disk_peak_bytes
    return out


def sources_metadata(outcome: SpeculatorOutcome) -> dict[str, object]:
    lines = [
        "| source | rows | held out | tokens | supervised | left out by the cap | duplicates |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in outcome.sources.items():
        lines.append(
            f"| {name} | {f.rows} | {f.held_out} | {f.tokens} | {f.supervised} | {f.capped} | "
            f"{f.duplicates} |"
        )
    return {
        "sources": dg.MetadataValue.md("\n".join(lines)),
        "duplicates_by_source_pair": dict(outcome.duplicates),
        **{f"rows_{name}": f.rows for name, f in outcome.sources.items()},
    }


def by_source_metadata(name: str, measured: DraftMeasurements) -> dict[str, object]:
    """A Markdown table draft × source (vLLM-measured acceptance), and this draft's
    figures per source as numbers (the Plots tab)."""
    sources = list(measured.trained)
    rows = {f"**{name}**": measured.trained}
    if measured.untrained:
        rows[f"{name} (untrained)"] = measured.untrained
    rows |= {f"{other} (its own draft)": figures for other, figures in measured.others.items()}
    lines = ["| draft | " + " | ".join(sources) + " |", "|---|" + "---:|" * len(sources)]
    for label, figures in rows.items():
        cells = [
            f"{figures[s].measured.acceptance_length:.3f}" if s in figures else "" for s in sources
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    table = dg.MetadataValue.md("\n".join(lines))
    return {"vllm_acceptance_by_source": table} | measurement_metadata(measured, sources, True)


def measurement_metadata(
    figures: DraftMeasurements, sources: Sequence[str], per_source: bool
) -> dict[str, object]:
    """`vllm_*` figures of the trained draft on each source, `vllm_untrained_*` of the
    untrained one when measured (keys end in `_<source>` when `per_source`). Beside them,
    the offline estimate replayed over the same replies (`*_estimate`), and how many
    generations equal the target's own reply."""
    out: dict[str, object] = {}
    drafts = {"vllm_": figures.trained, "vllm_untrained_": figures.untrained}
    for source in sources:
        end = f"_{source}" if per_source else ""
        out[f"vllm_prompts{end}"] = len(figures.trained[source].measured.prompts)
        for prefix, by_source in drafts.items():
            if source not in by_source:
                continue
            f = by_source[source]
            mine: dict[str, object] = {
                "acceptance_length": f.measured.acceptance_length,
                "per_position_acceptance": [round(r, 4) for r in f.measured.per_position],
                "drafts": f.measured.drafts,
                "measurement_reused": f.measured.reused,
            }
            if (interval := f.measured.interval) is not None:
                mine["acceptance_length_95ci"] = interval.text()
            if f.estimate is not None:
                mine["acceptance_length_estimate"] = f.estimate.acceptance_length
                rates = [round(r, 4) for r in f.estimate.per_position]
                mine["per_position_acceptance_estimate"] = rates
            if f.same_as_target is not None:
                mine["generations_same_as_target"] = f.same_as_target
            out |= {prefix + key + end: value for key, value in mine.items()}
    return out


def _figure() -> tuple[Figure, Axes]:
    # a bare Figure (no pyplot): no global state, safe in threads and without a display
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.2), dpi=90, layout="constrained")
    return fig, fig.add_subplot()


def png_markdown(fig: Figure, alt: str) -> dg.MetadataValue:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return dg.MetadataValue.md(f"![{alt}](data:image/png;base64,{encoded})")


def length_histogram(
    lengths: Sequence[int], xlabel: str = "tokens per row", unit: str = "rows", bins: int = 30
) -> dg.MetadataValue:
    """Counts per token length, with the median and 95th percentile marked."""
    if not lengths:
        return dg.MetadataValue.md(f"(no {unit})")
    arr = np.asarray(lengths)
    fig, ax = _figure()
    ax.hist(arr, bins=min(bins, max(1, len(set(lengths)))), color="#4c72b0")
    for q, style in ((50, "--"), (95, ":")):
        value = np.percentile(arr, q)
        ax.axvline(value, color="black", linestyle=style, label=f"p{q} = {value:,.0f}")
    ax.set(xlabel=xlabel, ylabel=unit, title=f"{len(arr):,} {unit}")
    ax.legend()
    return png_markdown(fig, "token length histogram")


def length_stats(lengths: Sequence[int]) -> dict[str, int]:
    if not lengths:
        return {}
    arr = np.asarray(lengths)
    return {
        "tokens_min": int(arr.min()),
        "tokens_p50": int(np.percentile(arr, 50)),
        "tokens_p95": int(np.percentile(arr, 95)),
        "tokens_max": int(arr.max()),
    }


def loss_curve(result: TrainResult) -> dg.MetadataValue:
    """Training loss per batch (and a running mean) with the epoch ends; after each epoch,
    the held-out loss and, on the right axis, the held-out acceptance estimate, the kept
    epoch marked."""
    if not result.batch_losses:
        return dg.MetadataValue.md("(no batches: the checkpoint was resumed complete)")
    losses = np.asarray(result.batch_losses, dtype=float)
    fig, ax = _figure()
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, color="#4c72b0", alpha=0.35, label="batch")
    window = max(1, len(losses) // 20)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1 :], smooth, color="#4c72b0", label=f"mean of {window}")
    per_epoch = len(losses) / max(len(result.epoch_losses), 1)
    ends = [round(e * per_epoch) for e in range(1, len(result.epoch_held_out_losses) + 1)]
    for end in ends[:-1]:
        ax.axvline(end + 0.5, color="grey", linewidth=0.6)
    if ends:
        ax.plot(ends, result.epoch_held_out_losses, "o--", color="#dd8452", label="held-out")
    ax.set(xlabel="batch", ylabel="loss (summed over draft steps)", title="training loss")
    ax.legend(loc="upper center")
    known = [(end, a) for end, a in zip(ends, result.epoch_acceptance, strict=True) if a]
    if known:
        right = ax.twinx()
        right.plot(*zip(*known, strict=True), "s-", color="#55a868", label="acceptance estimate")
        if result.kept_epoch:
            kept = result.epoch_acceptance[result.kept_epoch - 1]
            label = f"kept: epoch {result.kept_epoch}"
            at = ends[result.kept_epoch - 1]
            right.plot([at], [kept], "*", markersize=14, color="#c44e52", label=label)
        right.set_ylabel("held-out acceptance estimate")
        right.legend(loc="upper right")
    return png_markdown(fig, "loss curve")


def acceptance_plot(
    estimated_rates: Sequence[float], vllm_rates: Sequence[float] | None = None
) -> dg.MetadataValue:
    """Share of verifications accepting draft token i, per position: replayed offline over
    the held-out replies and, when measured, counted by vLLM."""
    estimate = np.asarray(estimated_rates, dtype=float)
    positions = np.arange(1, max(len(estimate), len(vllm_rates or ())) + 1)
    fig, ax = _figure()
    width = 0.4 if vllm_rates else 0.8
    shift = width / 2 if vllm_rates else 0
    ax.bar(positions[: len(estimate)] - shift, estimate, width, label="held-out estimate")
    if vllm_rates:  # served at another depth than trained: each at its own positions
        served = positions[: len(vllm_rates)]
        ax.bar(served + width / 2, vllm_rates, width, label="measured in vLLM")
    ax.set_xticks(positions)
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1))
    ax.set_title("per-position acceptance")
    ax.legend()
    return png_markdown(fig, "per-position acceptance")


def benchmark_plot(
    bench: str,
    rows: Sequence[BenchmarkFigures],
    speedup: Callable[[BenchmarkFigures], float | None],
) -> dg.MetadataValue:
    """Per category: acceptance length of each speculating method, and its speedup in
    output tokens/s over no speculation (1.0 marked)."""
    from matplotlib.figure import Figure

    categories = list(dict.fromkeys(r.category for r in rows))
    methods = [m for m in dict.fromkeys(r.method for r in rows) if m != "none"]
    fig = Figure(figsize=(7.0, 3.4), dpi=90, layout="constrained")
    accept_ax, speed_ax = fig.subplots(1, 2)
    x = np.arange(len(categories))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        mine = {r.category: r for r in rows if r.method == method}
        offsets = x - 0.4 + width * (i + 0.5)
        lengths = [(mine[c].acceptance_length or 1.0) if c in mine else 0.0 for c in categories]
        ratios = [(speedup(mine[c]) or 0.0) if c in mine else 0.0 for c in categories]
        accept_ax.bar(offsets, lengths, width, label=method)
        speed_ax.bar(offsets, ratios, width, label=method)
    speed_ax.axhline(1.0, color="gray", linewidth=0.8)
    for ax, title in ((accept_ax, "acceptance length"), (speed_ax, "speedup vs no speculation")):
        ax.set_xticks(x, categories, rotation=30, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    accept_ax.legend(fontsize=7)
    fig.suptitle(bench, fontsize=10)
    return png_markdown(fig, f"{bench} per category")


def table_links(tables: TableStore, table: str, partition: str) -> dict[str, dg.MetadataValue]:
    """Where the partition's table lies, and how to query it in the DuckDB catalog."""
    sql = f"SELECT * FROM {table} WHERE dataset = '{partition}' LIMIT 20;"
    return {
        "path": dg.MetadataValue.path(str(tables.path(table, partition))),  # or a URL
        "catalog": dg.MetadataValue.path(str(tables.catalog_path)),
        "query": dg.MetadataValue.md(
            f"Every table is a view in the catalog: in Python, "
            f"`{tables.connect_code()}.sql(query).show()`; "
            f"or `duckdb -readonly {tables.catalog_path}` with the DuckDB CLI.\n\n"
            f"```sql\n{sql}\n```"
        ),
    }


def quarantine_metadata(report: StageReport) -> dict[str, dg.MetadataValue | int]:
    """Rows kept and quarantined, why, and where the quarantine table lies."""
    assert report.kept is not None and report.quarantine is not None
    return {
        "rows": report.kept.num_rows,
        "quarantined": report.quarantine.num_rows,
        "drop_reasons": counts_table(report.reasons, "reason"),
        "quarantine_path": dg.MetadataValue.path(str(report.quarantine.path)),
    }


def rounded(metadata: Mapping[str, object], digits: int = 4) -> dict[str, object]:
    """Floats (also inside lists) to `digits` significant digits: a loss or a ratio is
    read, not diffed, and 17 digits only hide the ones that matter."""

    def tidy(value: object) -> object:
        if isinstance(value, float):
            return float(f"{value:.{digits}g}")
        if isinstance(value, list):
            return [tidy(v) for v in value]
        return value

    return {key: tidy(value) for key, value in metadata.items()}
