"""`python -m mm_assets.demo build|run`: the offline demo model and datasets, end to end.

build: writes a tiny random Qwen2.5-VL-style target (real processor classes and chat
       template, locally trained tokenizer) and two demo datasets under
       $MM_ASSETS_HOME/demo. Skipped when already built with the same builder version.
run:   build, then materialize the whole pipeline — down to the trained speculator, measured
       in vLLM — for both demo partitions through Dagster (run history in $DAGSTER_HOME),
       then the draft trained on both (`demo_mix`), and print what landed in storage and
       each draft's acceptance on each dataset's held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from mm_assets.common import paths

BUILD_VERSION = "1"
DEMO_PARTITIONS = ("demo_sharegpt4v_coco", "demo_sharegpt")
DEMO_DRAFTS = ("demo_mix",)  # trained on both, after them


def build(demo_dir: Path | None = None, force: bool = False) -> Path:
    """Build the demo target and datasets once; return the demo directory."""
    from mm_assets.demo.data import build_demo_datasets, demo_corpus
    from mm_assets.demo.target import build_demo_target

    demo_dir = demo_dir or paths.demo_dir()
    stamp = demo_dir / "BUILD"
    if not force and stamp.is_file() and stamp.read_text().strip() == BUILD_VERSION:
        return demo_dir
    if demo_dir.exists():
        shutil.rmtree(demo_dir)
    build_demo_datasets(demo_dir)
    build_demo_target(demo_dir / "target", demo_corpus(demo_dir))
    stamp.write_text(BUILD_VERSION)
    return demo_dir


def run(
    partitions: tuple[str, ...] = DEMO_PARTITIONS, drafts: tuple[str, ...] = DEMO_DRAFTS
) -> None:
    import dagster as dg

    paths.ensure_dagster_home()
    from mm_assets.definitions import defs

    build()
    instance = dg.DagsterInstance.get()
    speculators = {}
    # no run config: the demo's settings are its registry entries', as for the UI and CLI
    for partition in partitions:
        speculators[partition] = _materialize(defs, instance, "dataset_chain", partition)
    mixes = {draft: _materialize(defs, instance, "drafts", draft) for draft in drafts}
    _print_summary(partitions)
    for partition, meta in speculators.items():
        print(f"demo: {partition}: EAGLE-3 draft at {meta['checkpoint']}")
        print(_acceptance_table(meta))
    for draft, meta in mixes.items():
        print(f"demo: {draft}: EAGLE-3 draft on {', '.join(partitions)} at {meta['checkpoint']}")
        print(_draft_table(draft, meta, partitions))


def _materialize(defs: Any, instance: Any, job: str, partition: str) -> dict[str, Any]:
    """One partition of a job (`dataset_chain`, `drafts`); the metadata of its draft."""
    started = time.perf_counter()
    result = defs.resolve_job_def(job).execute_in_process(
        partition_key=partition, instance=instance
    )
    if not result.success:
        sys.exit(f"demo: materializing {partition} failed; see the run in `make dev`")
    print(f"demo: {partition}: materialized in {time.perf_counter() - started:.1f}s")
    asset = "trained_draft" if job == "drafts" else "trained_speculator"
    (mat,) = result.asset_materializations_for_node(asset)
    return {k: v.value for k, v in mat.metadata.items()}


def _draft_table(draft: str, meta: dict[str, Any], sources: tuple[str, ...]) -> str:
    """Acceptance vLLM measured on each source's held-out prompts: the draft of both,
    and each source's own draft on the same prompts (off its domain too)."""
    nan = float("nan")
    lines = [f"      {'draft':<24}" + "".join(f"{s:>24}" for s in sources)]
    rows = [(draft, "")] + [(f"{s} (own)", f"_by_{s}") for s in sources]
    for name, suffix in rows:
        cells = [meta.get(f"vllm_acceptance_length_{s}{suffix}", nan) for s in sources]
        lines.append(f"      {name:<24}" + "".join(f"{c:>24.3f}" for c in cells))
    prompts = ", ".join(f"{meta.get(f'vllm_prompts_{s}', 0)} {s}" for s in sources)
    lines.append(f"      (greedy, held-out prompts: {prompts})")
    return "\n".join(lines)


def _acceptance_table(meta: dict) -> str:
    """Trained next to untrained: vLLM's measurement on held-out prompts (acceptance length
    at the served number of draft tokens, and per position), and the offline estimate
    replayed over the same replies from their stored hidden states."""
    nan = float("nan")
    lines = [f"      {'':<10}{'vLLM measured':>15}  {'per position':<26}{'estimate':>9}"]
    for name, prefix in (("trained", ""), ("untrained", "untrained_")):
        measured = meta.get(f"vllm_{prefix}acceptance_length")
        positions = ", ".join(
            f"{r:.2f}" for r in meta.get(f"vllm_{prefix}per_position_acceptance", [])
        )
        estimate = meta.get(
            f"vllm_{prefix}acceptance_length_estimate",
            meta.get(f"{prefix}acceptance_length_estimate", nan),  # not served: all replies
        )
        shown = f"{measured:>15.3f}" if measured is not None else f"{'(not served)':>15}"
        lines.append(f"      {name:<10}{shown}  {'[' + positions + ']':<26}{estimate:>9.3f}")
    prompts = meta.get("vllm_prompts", 0)
    lines.append(
        f"      ({prompts} of {meta['held_out_replies']} held-out replies, greedy; estimate "
        f"over all of them: {meta['acceptance_length_estimate']:.3f})"
    )
    if (same := meta.get("vllm_generations_same_as_target")) is not None:
        lines.append(f"      lossless: {same} of {prompts} generations equal the target's own")
    return "\n".join(lines)


def _print_summary(partitions: tuple[str, ...]) -> None:
    from mm_assets.assets.resources import StorageResource

    tables = StorageResource().tables()
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
    args = parser.parse_args()
    if args.command == "build":
        print(f"demo: built under {build(force=args.force)}")
    else:
        if args.force:
            build(force=True)
        run()


if __name__ == "__main__":
    main()
