"""The demo's multimodal draft on the whole demo benchmark (40 prompts per category), at
depths 1, 3, 5 and 7, with 95% intervals: what `make demo` measures on 3 per category at
the draft's depth, large enough to tell drafts apart and to see where speculation pays.

Runs on the demo's home after `make demo` (the draft, the prepared benchmark and the
target are read from there) through the benchmark service the asset uses, with the
demo's settings but every prompt: no speculation, n-gram and the draft, one server each,
one request at a time. Prints each method's figures per category with their intervals,
and the draft against no speculation and against n-gram, paired on the same prompts, as
JSON. `make bench-quality` (~10 min here).
"""

from __future__ import annotations

import json
import os
import sys
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


def run(draft: str = DRAFT) -> dict[str, Any]:
    from mm_assets.assets.partitions import REGISTRY
    from mm_assets.assets.resources import StorageResource, TargetModelResource, VllmResource
    from mm_assets.domain.model.acceptance import OVERALL
    from mm_assets.domain.model.benchmark import NONE, comparison, intervals, method_of
    from mm_assets.domain.model.settings import BenchmarkSettings
    from mm_assets.services.benchmarking import benchmark, load_benchmark
    from mm_assets.services.engine import DraftUnderTest
    from mm_assets.services.media import media_root
    from mm_assets.storage.layout import StorageLayout

    storage = StorageResource()
    tables, root = storage.tables(), storage.root_dir()
    chosen = REGISTRY[draft].settings.get("speculator_benchmark", {})
    every = {"max_prompts_per_category": None, "speculative_tokens": DEPTHS}
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
        found = intervals(report.records, method_of(f), f.category)
        rows[f"{f.category} {f.method} {f.depth or ''}".strip()] = {
            "prompts": f.prompts,
            "requests": f.requests,
            "acceptance_length": _interval(found.acceptance_length),
            "tokens_per_s": _interval(found.tokens_per_s),
            "speedup": _interval(found.speedup),
            "lossless": f"{f.lossless}/{f.compared}" if f.lossless is not None else None,
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
        "benchmark": BENCHMARK,
        "settings": settings.model_dump(),
        "seconds": round(seconds, 1),
        "rows": rows,
        "paired": paired,
    }


def main() -> None:
    if "MM_ASSETS_HOME" not in os.environ:
        os.environ["MM_ASSETS_HOME"] = str(Path(__file__).resolve().parents[1] / ".mm_assets")
    print(json.dumps(run(*sys.argv[1:2]), indent=2))


if __name__ == "__main__":
    main()
