"""Peak memory and bytes written when rows carry large images inside them.

Each case is a fresh process that runs the real ingest path
(`services.ingest.load_raw_dataset` into a `TableStore`). The figure is the rise of its
peak RSS (`VmHWM`, reset just before the load) over its RSS then, after a warm-up load
of a one-row file (imports and the table store's first write are not the data's). The cases:
- `parquet_24x8MiB`: a zstd Parquet of 24 rows, each an 8 MiB image struct, as pyarrow
  writes it by default: all 24 images in one dictionary page. The file is small on disk,
  because the images compress to almost nothing.
- `parquet_24x8MiB_plain`: the same rows without dictionary encoding (still one 192 MiB
  page: pyarrow checks the page size once per 1,024 values).
- `parquet_24x8MiB_datasets`: the same rows as `datasets` writes an `Image` column
  (`Dataset.to_parquet`: plain, uncompressed, row groups of ~100 MB).
- `parquet_filtered_out`: the same file, with a filter that keeps no row. No image byte
  may be written.
- `data_url_40MiB`: one JSONL row holding a 40 MiB data URL.
- `data_url_40MiB_broken`: the same URL, with a line break every 4 base64 characters.

Issue 34's goals: a rise of at most 300 MiB for the Parquet, and 0 bytes written for a
row the filter drops.

`.venv/bin/python -m bench.embedded_memory` (about 1 min on 2 cores).
`--baseline DIR` also measures another checkout with this venv, on each case right after
this one (e.g. one unpacked by `git archive <commit> | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _image(i: int, size: int) -> bytes:
    """A PNG signature and `size` bytes, unique per row: compresses to almost nothing."""
    return b"\x89PNG\r\n\x1a\n" + i.to_bytes(4, "big") + bytes(size - 12)


def write_cases(directory: Path) -> dict[str, tuple[Path, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    turns = [{"from": "human", "value": "What is shown?"}, {"from": "gpt", "value": "A picture."}]
    schema = pa.schema(
        [
            ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
        ]
    )
    rows = [
        {"image": {"bytes": _image(i, 8 * MiB), "path": f"x{i}.png"}, "conversations": turns}
        for i in range(24)
    ]
    table = pa.Table.from_pylist(rows, schema=schema)
    parquet, plain = directory / "rows.parquet", directory / "plain.parquet"
    pq.write_table(table, parquet, compression="zstd")  # pyarrow's defaults: a dictionary
    pq.write_table(table, plain, compression="zstd", use_dictionary=False)
    del table
    as_datasets = directory / "datasets.parquet"
    _datasets_parquet(rows, as_datasets)
    del rows
    payload = base64.b64encode(_image(99, 30 * MiB)).decode()  # 40 MiB of base64
    url = "data:image/png;base64," + payload
    broken = "data:image/png;base64," + "\n".join(
        payload[i : i + 4] for i in range(0, len(payload), 4)
    )
    cases: dict[str, tuple[Path, dict]] = {
        "parquet_24x8MiB": (parquet, {}),
        "parquet_24x8MiB_plain": (plain, {}),
        "parquet_24x8MiB_datasets": (as_datasets, {}),
        "parquet_filtered_out": (parquet, {"filter": {"image_prefix": "coco/"}}),
    }
    for name, value in (("data_url_40MiB", url), ("data_url_40MiB_broken", broken)):
        path = directory / f"{name}.jsonl"
        path.write_text(json.dumps({"image": value, "conversations": turns}) + "\n")
        cases[name] = (path, {})
    return cases


def _datasets_parquet(rows: list[dict], path: Path) -> None:
    import datasets

    text = datasets.Value("string")
    features = datasets.Features(
        {
            "image": datasets.Image(decode=False),
            "conversations": [{"from": text, "value": text}],
        }
    )
    columns = {key: [row[key] for row in rows] for key in features}
    datasets.Dataset.from_dict(columns, features=features).to_parquet(str(path))


def _child(source: str, directory: str, extra: str) -> None:
    """Runs in the measured process: one load, then its figures as JSON on stdout."""
    from mm_assets.registry import DatasetSpec
    from mm_assets.services.ingest import load_raw_dataset
    from mm_assets.storage import TableStore

    root = Path(directory)
    tables = TableStore(root)
    warmup = root / "warmup.jsonl"  # imports and the table store's first write, not data
    warmup.write_text(json.dumps({"conversations": []}) + "\n")
    load_raw_dataset(
        DatasetSpec(name="warmup", path=str(warmup), format="sharegpt4v"), tables, root / "w"
    )
    spec = DatasetSpec(name="bench", path=source, format="sharegpt4v", **json.loads(extra))
    before = _rss_bytes()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak (VmHWM) restarts from here
    report = load_raw_dataset(spec, tables, root / "images" / "sha256")
    peak = _peak_bytes()
    images = root / "images"
    written = sum(p.stat().st_size for p in images.rglob("*") if p.is_file())
    print(
        json.dumps(
            {
                "rss_before_mib": before / MiB,
                "peak_rise_mib": (peak - before) / MiB,
                "image_bytes_written_mib": written / MiB,
                "rows": report.written.num_rows,
            }
        )
    )


def _peak_bytes() -> int:
    """VmHWM: this process's peak RSS (unlike `ru_maxrss`, not inherited at fork)."""
    with open("/proc/self/status") as fh:
        line = next(x for x in fh if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(source: Path, extra: dict, root: Path, repo: Path = REPO) -> dict:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    code = "import sys; from bench.embedded_memory import _child; _child(*sys.argv[1:])"
    if not (repo / "bench" / "embedded_memory.py").exists():  # an older scratch checkout
        shutil.copy(REPO / "bench" / "embedded_memory.py", repo / "bench")
    out = subprocess.run(
        [sys.executable, "-c", code, str(source), str(root), json.dumps(extra)],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"the measured load failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(directory: Path, baseline: Path | None) -> dict[str, dict[str, dict]]:
    results: dict[str, dict[str, dict]] = {}
    for name, (source, extra) in write_cases(directory).items():
        results[name] = {}
        for label, repo in (("this", REPO), ("baseline", baseline)):
            if repo is None:
                continue
            with tempfile.TemporaryDirectory(dir=directory) as root:
                results[name][label] = measure(source, extra, Path(root), repo)
            print(name, label, results[name][label], file=sys.stderr)
    return results


def markdown(results: dict[str, dict[str, dict]], command: str) -> str:
    lines = [
        f"`{command}` ({datetime.date.today()}):",
        "",
        "| case | peak RSS rise (MiB) | image bytes written (MiB) | rows |",
        "|---|---:|---:|---:|",
    ]
    for name, runs in results.items():
        for label, r in runs.items():
            tag = "" if label == "this" else " (baseline)"
            lines.append(
                f"| {name}{tag} | {r['peak_rise_mib']:.0f} | "
                f"{r['image_bytes_written_mib']:.1f} | {r['rows']} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to measure alongside")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run(Path(tmp), args.baseline)
    command = " ".join(["python -m bench.embedded_memory", *sys.argv[1:]])
    print(markdown(results, command))


if __name__ == "__main__":
    main()
