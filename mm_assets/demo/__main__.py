"""`python -m mm_assets.demo build|run`: the offline demo model and datasets, end to end.

build: writes two demo datasets, a demo benchmark and a tiny Qwen2.5-VL-style target
       trained to answer questions about its pictures under $MM_ASSETS_HOME/demo, and
       prints how often its answers are right (the trained target is copied from
       $MM_ASSETS_DEMO_CACHE when built there before by the same code and settings).
run:   build, then materialize the whole pipeline through Dagster for both demo
       partitions, then the draft trained on both (`demo_mix`), and print what landed in
       storage and each draft's acceptance in vLLM.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mm_assets.common import paths

BUILD_VERSION = "3"  # 2: the demo benchmark; 3: a trained target
DEMO_PARTITIONS = ("demo_sharegpt4v_coco", "demo_sharegpt")
DEMO_DRAFTS = ("demo_mix",)  # trained on both, after them
DEMO_BENCHMARK = "demo_benchmark"  # prepared first; each dataset's draft is measured on it
# The console shows the steps' own progress (INFO), not Dagster's per-step DEBUG events
# (`--verbose` shows them too); every event is still in the run's history (`make dev`).
QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
VERBOSE = {"loggers": {"console": {"config": {"log_level": "DEBUG"}}}}
# The demo is its machine's only vLLM user, and its steps serve the same target and drafts
# again and again (a measurement, then the benchmark): kept warm, a server starts once.
# Two kept, so no more servers run at once than the benchmark's three.
WARM_SERVERS = "2"


def build(demo_dir: Path | None = None, force: bool = False) -> Path:
    """Build the demo target and datasets once; return the demo directory."""
    from mm_assets.demo.benchmark import build_demo_benchmark
    from mm_assets.demo.data import build_demo_datasets
    from mm_assets.demo.target_training import build_trained_target, format_report

    demo_dir = demo_dir or paths.demo_dir()
    stamp = demo_dir / "BUILD"
    if not force and stamp.is_file() and stamp.read_text().strip() == BUILD_VERSION:
        return demo_dir
    if demo_dir.exists():
        shutil.rmtree(demo_dir)
    build_demo_datasets(demo_dir)
    build_demo_benchmark(demo_dir)
    cache = paths.demo_cache()
    with _one_builder(cache):
        report = build_trained_target(demo_dir / "target", demo_dir, cache=cache, say=_say)
    print("demo: the target's greedy answers to held-out questions")
    print(format_report(report), flush=True)
    stamp.write_text(BUILD_VERSION)
    return demo_dir


@contextmanager
def _one_builder(cache: Path | None) -> Iterator[None]:
    """One build at a time per target cache: test workers (`pytest -n`) or two demos
    started together train the target once, and the others copy it when it lands."""
    if cache is None:
        yield
        return
    with open(cache / ".build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _say(line: str) -> None:
    print(f"demo: {line}", flush=True)


def run(
    partitions: tuple[str, ...] = DEMO_PARTITIONS,
    drafts: tuple[str, ...] = DEMO_DRAFTS,
    verbose: bool = False,
) -> None:
    import dagster as dg

    from mm_assets.services.engine import KEEP_WARM_ENV

    os.environ.setdefault(KEEP_WARM_ENV, WARM_SERVERS)
    paths.ensure_dagster_home()
    from mm_assets.definitions import defs

    build()
    instance = dg.DagsterInstance.get()
    speculators = {}
    # no op config: the demo's settings are its registry entries', as for the UI and CLI
    logs = VERBOSE if verbose else QUIET
    _materialize(defs, instance, "prepare", DEMO_BENCHMARK, logs)
    for partition in partitions:
        speculators[partition] = _materialize(defs, instance, "dataset_chain", partition, logs)
    mixes = {draft: _materialize(defs, instance, "drafts", draft, logs) for draft in drafts}
    _print_summary(partitions)
    for partition, meta in speculators.items():
        print(f"demo: {partition}: EAGLE-3 draft at {meta['checkpoint']}")
        print(_acceptance_table(partition, meta))
    for draft, meta in mixes.items():
        print(f"demo: {draft}: EAGLE-3 draft on {', '.join(partitions)} at {meta['checkpoint']}")
        print(_draft_table(draft, partitions))
    print(_benchmark_table(partitions + drafts, DEMO_BENCHMARK))


def _materialize(
    defs: Any, instance: Any, job: str, partition: str, logs: dict[str, Any]
) -> dict[str, Any]:
    """One partition of a job (`logs`: the console logger's config); the metadata of its
    draft."""
    started = time.perf_counter()
    result = defs.resolve_job_def(job).execute_in_process(
        partition_key=partition, instance=instance, run_config=logs
    )
    if not result.success:
        sys.exit(f"demo: materializing {partition} failed; see the run in `make dev`")
    print(f"demo: {partition}: materialized in {time.perf_counter() - started:.1f}s")
    asset = "trained_draft" if job == "drafts" else "trained_speculator"
    materialized = result.asset_materializations_for_node(asset)
    if not materialized:  # a benchmark's partition: prepared, nothing trained
        return {}
    return {k: v.value for k, v in materialized[0].metadata.items()}


def _tables() -> Any:
    from mm_assets.assets.resources import StorageResource

    return StorageResource().tables()


def _measured(draft: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The draft's latest rows of `draft_measurements`, by (served, source)."""
    with _tables().connect() as con:
        cursor = con.execute(
            """
            SELECT * FROM draft_measurements WHERE draft = ?
            QUALIFY measured_at = max(measured_at) OVER ()
            """,
            [draft],
        )
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    return {(r["served"], r["source"]): r for r in rows}


def _draft_table(draft: str, sources: tuple[str, ...]) -> str:
    """Acceptance vLLM measured on each source's held-out prompts: the draft of both, and
    each source's own draft (on the same prompts when the mix was measured with
    `compare_with_sources`, else from its own measurement, on the same held-out rows)."""
    mine = _measured(draft)
    compared = sorted({served for served, _ in mine} - {"trained", "untrained"})
    rows = {draft: {s: mine.get(("trained", s)) for s in sources}}
    if compared:
        rows |= {f"{o} (own)": {s: mine.get((o, s)) for s in sources} for o in compared}
    else:
        own = {s: _measured(s).get(("trained", s)) for s in sources}
        rows["each dataset's own draft"] = own
    lines = [f"      {'draft':<28}" + "".join(f"{s:>24}" for s in sources)]
    for label, cells in rows.items():
        shown = [f"{c['acceptance_length']:>24.3f}" if c else f"{'-':>24}" for c in cells.values()]
        lines.append(f"      {label:<28}" + "".join(shown))
    prompts = ", ".join(
        f"{row['prompts'] if (row := mine.get(('trained', s))) else 0} {s}" for s in sources
    )
    lines.append(f"      (greedy, held-out prompts: {prompts}; table draft_measurements)")
    return "\n".join(lines)


def _benchmark_table(drafts: tuple[str, ...], bench: str) -> str:
    """Each draft on the benchmark, per category, from the `speculator_benchmarks` table;
    then each draft against n-gram, and the drafts against each other, on the same prompts
    from the requests behind them."""
    with _tables().connect() as con:
        rows = con.execute(
            """
            WITH latest AS (
                SELECT * FROM speculator_benchmarks WHERE benchmark = ? AND status = 'ok'
                QUALIFY measured_at = max(measured_at) OVER (PARTITION BY draft)
            )
            SELECT d.draft, d.category, d.prompts, d.acceptance_length, d.acceptance_low,
                   d.acceptance_high, g.acceptance_length, n.output_tokens_per_s, g.speedup,
                   d.speedup, d.speedup_low, d.speedup_high, d.lossless + g.lossless,
                   d.compared + g.compared, d.measurement, d.speculative_tokens
            FROM latest d
            JOIN latest g USING (draft, category)
            JOIN latest n USING (draft, category)
            WHERE d.method NOT IN ('none', 'ngram') AND g.method = 'ngram' AND n.method = 'none'
              AND g.speculative_tokens = d.speculative_tokens
            ORDER BY d.draft, d.category = 'overall', d.category
            """,
            [bench],
        ).fetchall()
    head = (
        f"      {'draft':<22}{'category':<18}{'n':>4}{'accept':>8}{'95% CI':>17}{'ngram':>7}"
        f"{'tok/s none':>11}{'x ngram':>8}{'x draft':>8}{'95% CI':>15}{'lossless':>10}"
    )
    lines = [f"demo: {bench}: each draft per category in vLLM (greedy)", head]
    measurements = {}
    for draft, category, n, *figures, same, compared, measurement, depth in rows:
        if draft not in drafts:
            continue
        measurements[draft] = (measurement, depth)
        accept, low, high, ngram_accept, none_tps, x_ngram, x_draft, x_low, x_high = figures
        lines.append(
            f"      {draft:<22}{category:<18}{n:>4}{accept:>8.3f}{f'[{low:.3f}, {high:.3f}]':>17}"
            f"{ngram_accept or 1.0:>7.3f}{none_tps:>11.1f}{x_ngram:>7.2f}x{x_draft:>7.2f}x"
            f"{f'[{x_low:.2f}, {x_high:.2f}]':>15}{f'{same}/{compared}':>10}"
        )
    lines += _comparisons(bench, measurements)
    lines.append(
        "      (n: prompts; accept: acceptance length, the draft's and n-gram's; tok/s: "
        "output tokens per second per request; x: speedup over no speculation; 95% CI: "
        "bootstrap over the prompts, the speedup paired with no speculation's; lossless: "
        "outputs of the draft and n-gram equal to no speculation's)"
    )
    return "\n".join(lines)


def _benchmark_records(draft: str, bench: str, measurement: str) -> list[Any]:
    """The requests behind a draft's benchmark rows (`speculator_benchmark_prompts`)."""
    from mm_assets.domain.model.acceptance import Acceptance
    from mm_assets.domain.model.benchmark import PromptFigures

    with _tables().connect() as con:
        found = con.execute(
            """
            SELECT category, method, conversation, round, output_tokens, latency_s, decode_s,
                   drafts, accepted, speculative_tokens, beside
            FROM speculator_benchmark_prompts
            WHERE draft = ? AND benchmark = ? AND measurement = ?
            """,
            [draft, bench, measurement],
        ).fetchall()
    return [
        PromptFigures(*row[:7], acceptance=Acceptance(row[7], row[8]), depth=row[9], beside=row[10])
        for row in found
    ]


def _paired(records: list[Any], methods: tuple[Any, Any]) -> str:
    """`methods[0]` against `methods[1]` over every category, prompt by prompt (95% CI)."""
    from mm_assets.domain.model.acceptance import OVERALL
    from mm_assets.domain.model.benchmark import comparison

    said = []
    for figure, label in (("acceptance_length", "acceptance"), ("tokens_per_s", "tokens/s")):
        ratio = comparison(records, methods, OVERALL, figure)
        if ratio is not None:
            said.append(f"{label} {ratio.value:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}]")
    n = len({r.prompt for r in records if (r.method, r.depth) == methods[0]})
    return f"on the same {n} prompts: " + ("; ".join(said) or "-")


def _comparisons(bench: str, measured: dict[str, tuple[str, int]]) -> list[str]:
    """Each draft against n-gram, then each pair of drafts (their requests, paired)."""
    from dataclasses import replace

    from mm_assets.domain.model.benchmark import BASELINES

    records = {d: _benchmark_records(d, bench, m) for d, (m, _) in measured.items()}
    family = {
        d: next((r.method for r in rs if r.method not in BASELINES), "")
        for d, rs in records.items()
    }
    lines = [
        f"      {d}: against n-gram {_paired(records[d], ((family[d], k), ('ngram', k)))}"
        for d, (_, k) in measured.items()
    ]
    drafts = list(measured)
    for i, a in enumerate(drafts):
        for b in drafts[i + 1 :]:
            both = [
                replace(r, method=d) for d in (a, b) for r in records[d] if r.method == family[d]
            ]
            pair = ((a, measured[a][1]), (b, measured[b][1]))
            lines.append(f"      {a} against {b} {_paired(both, pair)}")
    return lines


def _acceptance_table(partition: str, meta: dict) -> str:
    """Trained next to untrained: vLLM's measurement on held-out prompts, and the offline
    estimate replayed over the same replies from their stored hidden states."""
    measured = _measured(partition)
    lines = [
        f"      {'':<10}{'vLLM measured':>15}{'95% CI':>18}  {'per position':<26}{'estimate':>9}"
    ]
    for served in ("trained", "untrained"):
        row = measured.get((served, partition))
        if row is None:  # not served: the estimate over all held-out replies
            estimate = meta.get(
                f"{'' if served == 'trained' else 'untrained_'}acceptance_length_estimate"
            )
            lines.append(
                f"      {served:<10}{'(not served)':>15}{'':>18}  {'':<26}{estimate:>9.3f}"
            )
            continue
        positions = "[" + ", ".join(f"{r:.2f}" for r in row["per_position_acceptance"]) + "]"
        low, high = row["acceptance_low"], row["acceptance_high"]
        ci = f"[{low:.3f}, {high:.3f}]" if low is not None else "-"
        lines.append(
            f"      {served:<10}{row['acceptance_length']:>15.3f}{ci:>18}  {positions:<26}"
            f"{row['acceptance_length_estimate']:>9.3f}"
        )
    trained = measured.get(("trained", partition)) or {}
    prompts = trained.get("prompts", 0)
    lines.append(
        f"      ({prompts} of {meta['held_out_replies']} held-out replies, greedy; estimate "
        f"over all of them: {meta['acceptance_length_estimate']:.3f})"
    )
    if (same := trained.get("lossless")) is not None:
        lines.append(f"      lossless: {same} of {prompts} generations equal the target's own")
    return "\n".join(lines)


def _print_summary(partitions: tuple[str, ...]) -> None:
    tables = _tables()
    with tables.connect() as con:
        for partition in partitions:
            counts = {
                table: con.execute(
                    f'SELECT count(*) FROM "{table}" WHERE dataset = ?', [partition]
                ).fetchone()[0]
                for table in tables.table_names()
            }
            print(f"demo: {partition}: " + json.dumps(counts))
        reasons = con.execute(
            "SELECT dataset, reason, count(*) FROM normalized_conversations_quarantine "
            "GROUP BY ALL ORDER BY ALL"
        ).fetchall()
    print("demo: quarantined rows:", ", ".join(f"{d}/{r}: {n}" for d, r, n in reasons) or "none")
    print(f"demo: tables under {tables.location}; SQL catalog {tables.catalog_path}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m mm_assets.demo")
    parser.add_argument("command", choices=["build", "run"])
    parser.add_argument("--force", action="store_true", help="rebuild the demo from scratch")
    parser.add_argument(
        "--verbose", action="store_true", help="print Dagster's per-step events (DEBUG) too"
    )
    args = parser.parse_args()
    if args.command == "build":
        print(f"demo: built under {build(force=args.force)}")
    else:
        if args.force:
            build(force=True)
        run(verbose=args.verbose)


if __name__ == "__main__":
    main()
