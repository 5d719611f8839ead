"""Reading a registered dataset's rows: local files or the hub, filtered and subsampled.

Rows are kept as the JSON text of the record so every format fits one table schema and a
row that fails later is quarantined with its original content. A line that is not JSON
is kept too (with a parse error) instead of aborting the load.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from mm_assets.registry import DatasetSpec

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


@dataclass(frozen=True)
class RawRow:
    source_index: int
    record: Any  # the decoded record, or the raw text when it was not valid JSON
    parse_error: str | None = None

    def record_json(self) -> str:
        if self.parse_error is not None:
            return str(self.record)
        return json.dumps(self.record, ensure_ascii=False, default=str)


def read_local(path: Path) -> Iterator[RawRow]:
    """Rows of a json (list), jsonl or parquet file, or of every such file in a directory
    (sorted by name, so the row order — and the source index — is stable)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"{path} holds no {'/'.join(LOCAL_SUFFIXES)} files")
        records = (r.record if r.parse_error is None else r for f in files for r in read_local(f))
        for index, record in enumerate(records):
            if isinstance(record, RawRow):
                yield RawRow(index, record.record, record.parse_error)
            else:
                yield RawRow(index, record)
        return
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset file {path} does not exist; fix the entry's 'path' in the registry "
            f"(for the demo datasets run `python -m mm_assets.demo build`)"
        )
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        for index, record in enumerate(data):
            yield RawRow(index, record)
    elif path.suffix == ".parquet":
        index = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield RawRow(index, record)
                index += 1
    else:
        raise ValueError(f"{path}: unsupported file type; use one of {LOCAL_SUFFIXES}")


def _read_jsonl(path: Path) -> Iterator[RawRow]:
    with open(path, encoding="utf-8") as fh:
        index = 0
        for line in fh:
            if not line.strip():
                continue
            try:
                yield RawRow(index, json.loads(line))
            except json.JSONDecodeError as exc:
                yield RawRow(index, line.rstrip("\n"), parse_error=f"invalid JSON: {exc}")
            index += 1


def read_hub(path: str, subset: str | None, split: str) -> Iterator[RawRow]:
    """Rows through `datasets.load_dataset(path, name=subset, split=split)`: a hub id, or
    a local directory the `datasets` library can read."""
    import datasets  # heavy import, only on this path

    dataset = datasets.load_dataset(path, name=subset, split=split)
    for index, record in enumerate(dataset):
        yield RawRow(index, record)


# -- filters: selected by name from the registry entry -----------------------------


def _image_prefix(prefix: str) -> Callable[[Any], bool]:
    def keep(record: Any) -> bool:
        image = record.get("image") if isinstance(record, dict) else None
        images = image if isinstance(image, list) else [image]
        return any(isinstance(i, str) and i.startswith(prefix) for i in images)

    return keep


FILTERS: dict[str, Callable[[Any], Callable[[Any], bool]]] = {"image_prefix": _image_prefix}


def build_filter(spec: DatasetSpec) -> Callable[[RawRow], bool]:
    """All of the entry's filters at once. A row that is not valid JSON is kept, so it is
    quarantined later with a reason instead of vanishing."""
    checks = []
    for name, argument in spec.filter.items():
        if name not in FILTERS:
            raise ValueError(
                f"dataset {spec.name!r}: unknown filter {name!r}; known: {sorted(FILTERS)}"
            )
        checks.append(FILTERS[name](argument))
    return lambda row: row.parse_error is not None or all(c(row.record) for c in checks)


def subsample(rows: Iterable[RawRow], max_samples: int | None, seed: int) -> list[RawRow]:
    """A deterministic subset of at most `max_samples` rows, in source order."""
    rows = list(rows)
    if max_samples is None or len(rows) <= max_samples:
        return rows
    chosen = sorted(random.Random(seed).sample(range(len(rows)), max_samples))
    return [rows[i] for i in chosen]


@dataclass(frozen=True)
class LoadedRows:
    rows: list[RawRow]
    total: int  # rows in the source
    after_filter: int


def load_rows(spec: DatasetSpec) -> LoadedRows:
    """The dataset's rows: read, filtered, then subsampled (before any normalization)."""
    source = (
        read_hub(spec.hub, spec.subset, spec.split)
        if spec.hub
        else read_local(spec.resolved_path())
    )
    keep = build_filter(spec)
    total = 0
    kept: list[RawRow] = []
    for row in source:
        total += 1
        if keep(row):
            kept.append(row)
    return LoadedRows(subsample(kept, spec.max_samples, spec.seed), total, len(kept))
