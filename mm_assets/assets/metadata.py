"""Small formatters for the metadata a user reads in the Dagster UI."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import dagster as dg
import numpy as np


def counts_table(counts: Mapping[str, int], key: str, value: str = "rows") -> dg.MetadataValue:
    """A Markdown table of counts, largest first."""
    lines = [f"| {key} | {value} |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in Counter(counts).most_common()] or ["| (none) | 0 |"]
    return dg.MetadataValue.md("\n".join(lines))


def length_histogram(lengths: Sequence[int], bins: int = 10) -> dg.MetadataValue:
    """Token lengths as a Markdown bar chart."""
    if not lengths:
        return dg.MetadataValue.md("(no rows)")
    counts, edges = np.histogram(np.asarray(lengths), bins=bins)
    top = max(int(counts.max()), 1)
    lines = ["| tokens | rows | |", "|---|---:|---|"]
    for n, lo, hi in zip(counts, edges[:-1], edges[1:], strict=True):
        lines.append(f"| {int(lo)}–{int(hi)} | {int(n)} | {'█' * round(20 * int(n) / top)} |")
    return dg.MetadataValue.md("\n".join(lines))


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


def line_chart(values: Sequence[float], x: str, y: str, points: int = 24) -> dg.MetadataValue:
    """A Markdown chart of a series (e.g. the loss curve), downsampled to `points` rows."""
    if not values:
        return dg.MetadataValue.md("(no values)")
    step = max(1, len(values) // points)
    rows = [(i, float(np.mean(values[i : i + step]))) for i in range(0, len(values), step)]
    top = max(v for _, v in rows) or 1.0
    lines = [f"| {x} | {y} | |", "|---:|---:|---|"]
    lines += [f"| {i + 1} | {v:.4f} | {'█' * max(1, round(30 * v / top))} |" for i, v in rows]
    return dg.MetadataValue.md("\n".join(lines))


def bar_chart(labels: Sequence[str], values: Sequence[float]) -> dg.MetadataValue:
    lines = ["| | value | |", "|---|---:|---|"]
    lines += [
        f"| {k} | {v:.3f} | {'█' * round(30 * v)} |" for k, v in zip(labels, values, strict=True)
    ]
    return dg.MetadataValue.md("\n".join(lines))
