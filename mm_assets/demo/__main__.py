"""`python -m mm_assets.demo build|run`: the offline demo model and datasets, end to end.

build: writes a tiny random Qwen2.5-VL-style target (real processor classes and chat
       template, locally trained tokenizer) and two demo datasets under
       $MM_ASSETS_HOME/demo. Skipped when already built with the same builder version.
run:   build, then materialize the whole pipeline — down to the trained speculator, measured
       in vLLM — for both demo partitions through Dagster (run history in $DAGSTER_HOME),
       and print what landed in storage.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from mm_assets.common import paths

BUILD_VERSION = "1"
DEMO_PARTITIONS = ("demo_sharegpt4v_coco", "demo_sharegpt")


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


def run(partitions: tuple[str, ...] = DEMO_PARTITIONS) -> None:
    import dagster as dg

    paths.ensure_dagster_home()
    from mm_assets.definitions import defs

    build()
    instance = dg.DagsterInstance.get()
    job = defs.resolve_implicit_global_asset_job_def()
    speculators = {}
    for partition in partitions:
        started = time.perf_counter()
        result = job.execute_in_process(partition_key=partition, instance=instance)
        if not result.success:
            sys.exit(f"demo: materializing {partition} failed; see the run in `make dev`")
        print(f"demo: {partition}: materialized in {time.perf_counter() - started:.1f}s")
        (mat,) = result.asset_materializations_for_node("trained_speculator")
        speculators[partition] = {k: v.value for k, v in mat.metadata.items()}
    _print_summary(partitions)
    for partition, meta in speculators.items():
        print(
            f"demo: {partition}: EAGLE-3 draft at {meta['checkpoint']}\n"
            f"      held-out acceptance estimate {meta['acceptance_length_estimate']:.3f} "
            f"(untrained {meta['untrained_acceptance_length_estimate']:.3f}); "
            f"measured in vLLM: {meta.get('vllm_acceptance_length', float('nan')):.3f} "
            f"per position {meta.get('vllm_per_position_acceptance')}"
        )


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
    print(f"demo: tables under {tables.tables_dir}; SQL catalog {tables.catalog_path}")


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
