"""Peak RSS of the `tokenized_samples` asset on 500 vs 5,000 multimodal samples.

Each measurement is a fresh process that materializes only `tokenized_samples` (its
upstream was materialized by another process), so `ru_maxrss` is that stage's peak.
The ratio shows whether memory grows with the number of samples (the lazy design keeps
it flat: rows stream from Parquet to Parquet and no image is decoded).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = (500, 5000)


def _env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "MM_ASSETS_HOME": str(home),
        "DAGSTER_HOME": str(home / "dagster_home"),
        "MM_ASSETS_DATASETS": str(home / "datasets.yaml"),
        "MM_ASSETS_TARGET_MODEL": str(home / "target"),
    }


def prepare(home: Path) -> None:
    from bench.synthetic import make_images, make_records
    from bench.tokenize_lazy_vs_pixels import QWEN25_VL_MAX_PIXELS, QWEN25_VL_MIN_PIXELS
    from mm_assets.demo.target import build_demo_target

    refs = make_images(home / "coco", max(SIZES))
    entries = []
    for n in SIZES:
        records = make_records(refs[:n], n)
        (home / f"bench_{n}.json").write_text(json.dumps(records))
        entries.append(
            f"bench_{n}:\n  path: {home}/bench_{n}.json\n  format: sharegpt4v\n"
            f"  image_root: {home}/coco\n  image_path_strip_prefix: 'coco/'\n"
        )
    (home / "datasets.yaml").write_text("\n".join(entries))
    corpus = [t["value"] for r in make_records(refs[:200], 200) for t in r["conversations"]]
    build_demo_target(
        home / "target", corpus, min_pixels=QWEN25_VL_MIN_PIXELS, max_pixels=QWEN25_VL_MAX_PIXELS
    )


def _stage(stage: str, partition: str) -> None:
    """Runs inside the child process."""
    import dagster as dg

    from mm_assets.definitions import defs

    names = (
        ["raw_dataset", "coco_image_availability", "normalized_conversations"]
        if stage == "upstream"
        else ["tokenized_samples"]
    )
    assets = [defs.get_assets_def(n) for n in names]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = dg.materialize(
        assets,
        partition_key=partition,
        resources=defs.resources,
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rss_after_imports_mb": before / 1024, "peak_rss_mb": peak / 1024}))


def run(home: Path) -> dict:
    prepare(home)
    env = _env(home)
    out: dict = {}
    for n in SIZES:
        for stage in ("upstream", "tokenize"):
            proc = subprocess.run(
                [sys.executable, "-m", "bench.tokenize_memory", "--stage", stage, f"bench_{n}"],
                env=env,
                capture_output=True,
                text=True,
                check=False,
                cwd=Path(__file__).resolve().parents[1],
            )
            if proc.returncode:
                raise RuntimeError(proc.stderr[-3000:])
            if stage == "tokenize":
                out[n] = json.loads(proc.stdout.strip().splitlines()[-1])
    small, large = out[SIZES[0]], out[SIZES[1]]
    return {
        **{f"peak_rss_mb_{n}": round(out[n]["peak_rss_mb"], 1) for n in SIZES},
        **{
            f"growth_over_imports_mb_{n}": round(
                out[n]["peak_rss_mb"] - out[n]["rss_after_imports_mb"], 1
            )
            for n in SIZES
        },
        "ratio": large["peak_rss_mb"] / small["peak_rss_mb"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", choices=["upstream", "tokenize"])
    parser.add_argument("partition", nargs="?")
    args = parser.parse_args()
    if args.stage:
        _stage(args.stage, args.partition)
        return
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(Path(tmp)), indent=2))


if __name__ == "__main__":
    main()
