"""Peak RSS of materializing `raw_dataset` from a 100k- vs a 1M-row local source.

ShareGPT4V ships as one ~1.2M-record JSON list: an entry keeping every row must not hold
them all before the table is written, and one with `--max-samples 50000` must not hold
the whole source to keep 50,000 rows of it. Each measurement is a fresh
process running the real ingest path (`services.ingest.load_raw_dataset` into a
`TableStore`) on a synthetic ShareGPT4V-like source: 80% of the rows reference a `coco/`
image and are kept by the entry's `image_prefix: coco/` filter, the rest reference `sam/`
images. Every source is written twice, as a `.json` list and as `.jsonl`. `ru_maxrss` in
the child is its peak; the goal is peak(1M) / peak(100k) <= 1.2 for both formats. The
written table's hash shows both formats (and two commits) select the same rows.

`.venv/bin/python -m bench.raw_memory` (~2 min on 2 cores, ~4 with `--baseline`). The
sources go to a temporary directory and are deleted after use: 65 MB per format at 100k
rows, 646 MB per format at 1M rows (~1.3 GB on disk at once). `--sizes 1000 10000` for a
quick try.
`--baseline DIR` also measures another checkout with this venv (e.g. one unpacked by
`git archive <commit> | tar -x -C DIR`) on each source right after this one, so the two
share the machine's load: on a busy machine their timings compare, the absolutes do not.

`--prep` measures the prep chain instead, on the `.json` list: `raw_dataset`,
`coco_image_availability` and `normalized_conversations`, each stage in its own fresh
process (as Dagster runs steps) through the service its asset calls. The `coco/` rows
reference a pool of `IMAGE_POOL` small generated JPEGs, so their rows are kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = (100_000, 1_000_000)
FORMATS = (".json", ".jsonl")
SEED = 0
COCO_SHARE = 0.8
IMAGE_POOL = 1000  # distinct images the rows reference with `--prep` (files on disk)
STAGES = ("raw_dataset", "coco_image_availability", "normalized_conversations")
REPO = Path(__file__).resolve().parents[1]

_SENTENCES = (
    "The image shows a {c} bus parked beside a busy street with people waiting nearby.",
    "In the foreground a {c} umbrella shelters a small table set for two.",
    "Several {c} kites fly above a wide beach under a clear afternoon sky.",
    "A cat with {c} fur sleeps on a windowsill next to a potted plant.",
    "The kitchen counter holds a {c} kettle, a cutting board and a bowl of fruit.",
)
_COLOURS = ("red", "green", "blue", "yellow", "white", "black", "grey", "orange")


def _record(i: int, rng: random.Random, pool: int) -> dict:
    """One ShareGPT4V-like record: an image reference and a question with a ~300-700
    character answer (the size of ShareGPT4V's detailed captions is similar)."""
    if rng.random() < COCO_SHARE:
        image = f"coco/train2017/{rng.randrange(pool):012d}.jpg"
    else:
        image = f"sam/images/sa_{rng.randrange(300_000)}.jpg"
    answer = " ".join(
        rng.choice(_SENTENCES).format(c=rng.choice(_COLOURS)) for _ in range(rng.randint(4, 9))
    )
    return {
        "id": f"{i:09d}",
        "image": image,
        "conversations": [
            {"from": "human", "value": "<image>\nWhat do you see happening in this image?"},
            {"from": "gpt", "value": answer},
        ],
    }


def write_sources(directory: Path, rows: int, pool: int = 600_000) -> dict[str, Path]:
    """The same records as `<rows>.json` (a list) and `<rows>.jsonl`, written a record at a
    time so generating 1M rows does not need the memory the bench is measuring."""
    rng = random.Random(SEED)
    paths = {fmt: directory / f"source_{rows}{fmt}" for fmt in FORMATS}
    with (
        open(paths[".json"], "w", encoding="utf-8") as as_list,
        open(paths[".jsonl"], "w", encoding="utf-8") as as_lines,
    ):
        as_list.write("[\n")
        for i in range(rows):
            text = json.dumps(_record(i, rng, pool), ensure_ascii=False)
            as_list.write(("" if i == 0 else ",\n") + text)
            as_lines.write(text + "\n")
        as_list.write("\n]\n")
    return paths


def _child(source: Path, root: Path, max_samples: int | None, stage: str = STAGES[0]) -> None:
    """Runs in the fresh process: one stage's materialization, then its peak RSS."""
    from mm_assets.domain.ingest.embedded_images import embedded_images_dir
    from mm_assets.domain.ingest.images import DEFAULT_MAX_PIXELS
    from mm_assets.registry import DatasetSpec
    from mm_assets.services.ingest import load_raw_dataset, probe_dataset_images
    from mm_assets.services.prep import normalize_partition
    from mm_assets.storage import TableStore

    spec = DatasetSpec(
        name="bench_raw",
        path=str(source),
        format="sharegpt4v",
        filter={"image_prefix": "coco/"},
        max_samples=max_samples,
        seed=SEED,
        image_root=str(source.parent / "coco"),
        image_path_strip_prefix="coco/",
    )
    tables, images = TableStore(root), embedded_images_dir(root)
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    if stage == "raw_dataset":
        report = load_raw_dataset(spec, tables, images)
        rows = {"source_rows": report.source_rows, "rows_after_filter": report.rows_after_filter}
        written = report.written
    elif stage == "coco_image_availability":
        written = probe_dataset_images(spec, tables, DEFAULT_MAX_PIXELS, images).written
        rows = {}
    else:
        written = normalize_partition(spec, tables).kept
        rows = {}
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(
        json.dumps(
            {
                "peak_rss_mb": round(after.ru_maxrss / 1024, 1),
                "rss_after_imports_mb": round(before.ru_maxrss / 1024, 1),
                "seconds": round(seconds, 1),
                "cpu_seconds": round(cpu, 1),
                **rows,
                "rows_written": written.num_rows,
                "table_sha256": written.content_hash[:16],
            }
        )
    )


def measure(
    source: Path, root: Path, max_samples: int | None, repo: Path = REPO, stage: str = STAGES[0]
) -> dict:
    """One fresh process materializing `raw_dataset` with `repo`'s code (this file runs
    as a script there, so `mm_assets` is imported from `repo`, not from this checkout)."""
    script = [sys.executable, str(Path(__file__).resolve())]
    proc = subprocess.run(
        [*script, "--child", str(source), "--root", str(root)]
        + (["--max-samples", str(max_samples)] if max_samples else [])
        + ["--stage", stage],
        capture_output=True,
        text=True,
        check=False,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    if proc.returncode:
        raise RuntimeError(f"measuring {source} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(
    directory: Path,
    sizes: tuple[int, ...] = SIZES,
    baseline: Path | None = None,
    max_samples: int | None = None,
) -> dict:
    """Figures per checkout ("this", and "baseline" when given), format and size."""
    directory.mkdir(parents=True, exist_ok=True)
    repos = {"this": REPO, **({"baseline": baseline} if baseline else {})}
    results: dict = {"max_samples": max_samples, "checkouts": {name: {} for name in repos}}
    for rows in sizes:
        for fmt, path in write_sources(directory, rows).items():
            for name, repo in repos.items():
                store = directory / f"store_{name}_{rows}{fmt.replace('.', '_')}"
                figures = measure(path, store, max_samples, repo)
                figures["file_mb"] = round(path.stat().st_size / 2**20, 1)
                by_format = results["checkouts"][name].setdefault(fmt, {"rows": {}})
                by_format["rows"][rows] = figures
            path.unlink()
    for by_format in (f for c in results["checkouts"].values() for f in c.values()):
        small, large = by_format["rows"][min(sizes)], by_format["rows"][max(sizes)]
        by_format["ratio"] = round(large["peak_rss_mb"] / small["peak_rss_mb"], 3)
    return results


def run_prep(directory: Path, sizes: tuple[int, ...] = SIZES) -> dict:
    """Peak RSS per prep stage and source size (the `.json` list, every row kept)."""
    from bench.synthetic import make_images

    directory.mkdir(parents=True, exist_ok=True)
    make_images(directory / "coco", IMAGE_POOL, base=64)
    results: dict = {}
    for rows in sizes:
        paths = write_sources(directory, rows, IMAGE_POOL)
        paths[".jsonl"].unlink()
        store = directory / f"store_prep_{rows}"
        results[rows] = {s: measure(paths[".json"], store, None, REPO, s) for s in STAGES}
        paths[".json"].unlink()
    return results


def prep_markdown(results: dict, command: str) -> str:
    lines = [
        f"Measured {datetime.date.today().isoformat()}; `{command}`; peak RSS per stage (MB).",
        "",
        "| source rows | " + " | ".join(STAGES) + " | chain peak |",
        "|---:|" + "---:|" * (len(STAGES) + 1),
    ]
    for rows, stages in results.items():
        cells = [f"{stages[s]['peak_rss_mb']:,.0f} ({stages[s]['seconds']:.0f} s)" for s in STAGES]
        peak = max(stages[s]["peak_rss_mb"] for s in STAGES)
        lines.append(f"| {rows:,} | {' | '.join(cells)} | **{peak:,.0f}** |")
    return "\n".join(lines)


def markdown(results: dict, command: str) -> str:
    today = datetime.date.today().isoformat()
    lines = [
        f"Measured {today}; `{command}`; `max_samples: {results['max_samples']}`.",
        "",
        "| checkout | format | source rows | file | after filter | peak RSS | over imports "
        "| seconds (CPU) | table hash |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    checkouts = results["checkouts"]
    for name, formats in checkouts.items():
        for fmt, by_format in formats.items():
            for rows, f in by_format["rows"].items():
                lines.append(
                    f"| {name} | `{fmt}` | {rows:,} | {f['file_mb']:,.0f} MB | "
                    f"{f['rows_after_filter']:,} | {f['peak_rss_mb']:,.0f} MB | "
                    f"{f['peak_rss_mb'] - f['rss_after_imports_mb']:,.0f} MB | "
                    f"{f['seconds']:.1f} ({f['cpu_seconds']:.1f}) | `{f['table_sha256']}` |"
                )
    lines.append("")
    for name, formats in checkouts.items():
        ratios = ", ".join(f"`{fmt}` **{f['ratio']:.2f}**" for fmt, f in formats.items())
        lines.append(f"- {name}: peak RSS, largest / smallest source: {ratios} (goal <= 1.2)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs=2, default=SIZES, metavar=("SMALL", "LARGE"))
    parser.add_argument("--baseline", type=Path, help="another checkout to measure too")
    parser.add_argument("--max-samples", type=int, help="the entry's max_samples (default: none)")
    parser.add_argument("--prep", action="store_true", help="measure the prep chain's stages")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stage", default=STAGES[0], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.root, args.max_samples, args.stage)
        return
    if args.prep:
        with tempfile.TemporaryDirectory() as tmp:
            prep = run_prep(Path(tmp), tuple(args.sizes))
        print(prep_markdown(prep, " ".join(["python -m bench.raw_memory", *sys.argv[1:]])))
        print(json.dumps(prep, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = run(Path(tmp), tuple(args.sizes), args.baseline, args.max_samples)
    command = ".venv/bin/python -m bench.raw_memory"
    if tuple(args.sizes) != SIZES:
        command += " --sizes " + " ".join(map(str, args.sizes))
    if args.max_samples:
        command += f" --max-samples {args.max_samples}"
    if args.baseline:
        command += f" --baseline {args.baseline}"
    print(markdown(results, command))
    print()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
