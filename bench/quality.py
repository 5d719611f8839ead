"""The demo's multimodal draft on the whole demo benchmark (40 prompts per category), at
depths 1, 3, 5 and 7, with 95% intervals: what `make demo` measures on 3 per category at
the draft's depth, large enough to tell drafts apart and to see where speculation pays.

Runs on the demo's home after `make demo` (the draft, the prepared benchmark and the
target are read from there) through the benchmark service the asset uses, with the
demo's settings but every prompt: no speculation, n-gram and the draft, one server each,
one request at a time. Prints each method's figures per category with their intervals,
and the draft against no speculation and against n-gram, paired on the same prompts, as
JSON. `make bench-quality` (~10 min here); `python -m bench.quality [DRAFT] [--depths D ...]`
for another draft of the home's registry (any family) or other depths.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

DRAFT = "demo_sharegpt4v_coco"
BENCHMARK = "demo_benchmark"
DEPTHS = [1, 3, 5, 7]


def _interval(found: Any) -> dict[str, float | int] | None:
    if found is None:
        return None
    figures = {"value": found.value, "low": found.low, "high": found.high}
    return {**{k: round(v, 4) for k, v in figures.items()}, "n": found.n,
            "half_width": round(found.half_width, 4)}  # fmt: skip


def _beside(records: list[Any], row: Any) -> float | None:
    """No speculation's tokens/s over its requests sent in turn with `row`'s method: the
    figure its speedup is paired with (the machine's speed drifts between depths)."""
    from mm_assets.domain.model.benchmark import NONE, label, method_of, prompt_totals

    if method_of(row) == NONE:
        return None
    pairs = prompt_totals(records, NONE, row.category, label(method_of(row))).values()
    seconds = sum(t.latency_s for t in pairs)
    return round(sum(t.output_tokens for t in pairs) / seconds, 1) if seconds else None


def run(draft: str = DRAFT, depths: list[int] = DEPTHS) -> dict[str, Any]:
    from mm_assets.assets.partitions import ALL_DRAFTS, REGISTRY
    from mm_assets.assets.resources import StorageResource, TargetModelResource, VllmResource
    from mm_assets.domain.model.acceptance import OVERALL
    from mm_assets.domain.model.benchmark import NONE, comparison, method_of
    from mm_assets.domain.model.settings import BenchmarkSettings
    from mm_assets.services.benchmarking import benchmark, load_benchmark
    from mm_assets.services.engine import DraftUnderTest
    from mm_assets.services.media import media_root
    from mm_assets.storage.layout import StorageLayout

    storage = StorageResource()
    tables, root = storage.tables(), storage.root_dir()
    chosen = ALL_DRAFTS[draft].settings.get("speculator_benchmark", {})
    every = {"max_prompts_per_category": None, "speculative_tokens": depths}
    settings = BenchmarkSettings(**{**chosen, **every})
    prompts = load_benchmark(tables, BENCHMARK)
    target = TargetModelResource().model()
    serving = VllmResource().serving(
        target, media_root(REGISTRY[BENCHMARK], tables, root), root / "logs" / "bench_quality.log"
    )
    started = time.perf_counter()
    report = benchmark(
        serving,
        prompts.categories,
        DraftUnderTest.at(StorageLayout(root).draft(draft)),
        settings,
        root / "bench_quality_records",
        reuse=False,
    )
    seconds = time.perf_counter() - started
    rows = {}
    for f in report.rows:
        found = report.row_intervals[(f.category, method_of(f))]
        rows[f"{f.category} {f.method} {f.depth or ''}".strip()] = {
            "category": f.category,
            "method": f.method,
            "depth": f.depth,
            "prompts": f.prompts,
            "requests": f.requests,
            "acceptance_length": _interval(found.acceptance_length),
            "tokens_per_s": _interval(found.tokens_per_s),
            "speedup": _interval(found.speedup),
            "lossless": f"{f.lossless}/{f.compared}" if f.lossless is not None else None,
            "none_beside_tokens_per_s": _beside(report.records, f),
        }
    depths = sorted({f.depth for f in report.rows} - {None})
    paired = {
        f"{category} {report.draft_method}/{other[0]} at {depth} {figure}": _interval(
            comparison(report.records, ((report.draft_method, depth), other), category, figure)
        )
        for depth in depths
        for category in [*prompts.categories, OVERALL]
        for other in (("ngram", depth), NONE)
        for figure in ("acceptance_length", "tokens_per_s")
        if not (other == NONE and figure == "acceptance_length")
    }
    return {
        "draft": draft,
        "family": report.draft_method,
        "benchmark": BENCHMARK,
        "settings": settings.model_dump(),
        "seconds": round(seconds, 1),
        "rows": rows,
        "paired": paired,
    }


def _text(found: dict[str, Any] | None, digits: int = 3) -> str:
    if not found:
        return "–"
    return f"{found['value']:.{digits}f} [{found['low']:.{digits}f}, {found['high']:.{digits}f}]"


def markdown(result: dict[str, Any]) -> str:
    """The depth table (overall) and the per-category table at each depth, for
    BENCHMARKS.md."""
    paired, draft = result["paired"], result["family"]
    rows = {(r["category"], r["method"], r["depth"]): r for r in result["rows"].values()}
    depths = sorted({d for _, m, d in rows if m == draft})
    lines = [
        "| depth | draft acceptance | ±% | n-gram acceptance | draft ÷ n-gram (paired) | "
        "draft speedup (paired) | n-gram speedup (paired) | tokens/s: none beside → draft |",
        "|---:|---|---:|---|---|---|---|---|",
    ]
    for d in depths:
        mine, ngram = rows[("overall", draft, d)], rows[("overall", "ngram", d)]
        versus = paired[f"overall {draft}/ngram at {d} acceptance_length"]
        accept = mine["acceptance_length"]
        lines.append(
            f"| {d} | {_text(accept)} | {100 * accept['half_width']:.1f} | "
            f"{_text(ngram['acceptance_length'])} | {_text(versus, 2)} | "
            f"{_text(mine['speedup'], 2)} | {_text(ngram['speedup'], 2)} | "
            f"{mine['none_beside_tokens_per_s']} → {mine['tokens_per_s']['value']:.1f} |"
        )
    categories = [c for c, m, _ in rows if m == "none" and c != "overall"]
    for d in depths:
        lines += ["", f"At depth {d}, per category (n = conversations):", ""]
        lines += ["| category | n | draft acceptance | n-gram acceptance | draft speedup | "
                  "tokens/s: none beside → draft |", "|---|---:|---|---|---|---|"]  # fmt: skip
        for c in [*categories, "overall"]:
            mine, ngram = rows[(c, draft, d)], rows[(c, "ngram", d)]
            speed = f"{mine['none_beside_tokens_per_s']} → {mine['tokens_per_s']['value']:.1f}"
            lines.append(
                f"| {c} | {mine['prompts']} | {_text(mine['acceptance_length'])} | "
                f"{_text(ngram['acceptance_length'])} | {_text(mine['speedup'], 2)} | {speed} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quality")
    parser.add_argument("draft", nargs="?", default=DRAFT, help="a draft of the home's registry")
    parser.add_argument("--depths", nargs="+", type=int, default=DEPTHS)
    args = parser.parse_args()
    if "MM_ASSETS_HOME" not in os.environ:
        os.environ["MM_ASSETS_HOME"] = str(Path(__file__).resolve().parents[1] / ".mm_assets")
    result = run(args.draft, args.depths)
    print(json.dumps(result, indent=2), flush=True)
    print(markdown(result))


if __name__ == "__main__":
    main()
