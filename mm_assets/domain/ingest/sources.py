"""Reading a registered dataset's rows: local files or the hub, filtered and subsampled.

Rows are kept as the JSON text of the record so every format fits one table schema and a
row that fails later is quarantined with its original content. A line that is not JSON
is kept too (with a parse error) instead of aborting the load.

Memory is flat in the source's size: every format is read a record at a time, and
`max_samples` is applied in two passes (count the rows that pass the filter, then keep
the chosen ones) instead of holding the whole source to sample from it. ShareGPT4V is
~1.2M records; an entry keeping 50,000 of them holds 50,000.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import ijson
import pyarrow.parquet as pq

from mm_assets.registry import DatasetSpec

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
T = TypeVar("T")


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
        yield from _read_json_list(path)
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


def _read_json_list(path: Path) -> Iterator[RawRow]:
    r"""Records of a `.json` file holding one list, decoded one at a time.

    ShareGPT4V ships as one such file; `json.loads` on it held every record at once (2.2 GB
    of RSS for a 650 MB, 1M-record file). ijson's C backend streams it in ~15 MB. On that
    file it decoded every record in 3.6–5.3 s against 6.4–8.7 s for DuckDB's
    `read_json_objects(format='array')` plus `json.loads` per record, which also peaked at
    ~120 MB and would bring DuckDB into the pure domain (the import contract forbids it).
    `use_float=True` makes numbers int or float as with `json.loads` (never Decimal), so
    `RawRow.record_json` is unchanged. The C parser refuses three things `json.loads`
    accepts: integers beyond 64 bits, NaN/Infinity and unpaired `\uD800`-style escapes;
    such a file fails with a message naming it and the way out (.jsonl).
    """
    read = 0
    with open(path, "rb") as fh:
        _expect_list(path, fh)
        try:
            for record in ijson.items(fh, "item", use_float=True):
                yield RawRow(read, record)
                read += 1
        except (ijson.JSONError, UnicodeDecodeError) as exc:
            reason = str(exc).strip().splitlines()[0]
            raise ValueError(
                f"{path}: not a valid JSON list of records after record {read} ({reason}). "
                f"Fix or re-download the file; if Python's json module reads it (integers "
                f"beyond 64 bits, NaN/Infinity or unpaired \\u surrogate escapes, which the "
                f"streaming reader refuses), convert it to .jsonl, one record per line"
            ) from exc


def _expect_list(path: Path, fh: BinaryIO) -> None:
    """Refuses a `.json` file that is not a list before streaming it: the streaming
    parser would otherwise find no list items in an object and read zero rows."""
    first = b""
    while not first and (chunk := fh.read(65536)):
        first = chunk.lstrip()[:1]
    fh.seek(0)
    if first != b"[":
        found = {b"": "nothing", b"{": "an object"}.get(first, repr(first.decode("latin-1")))
        raise ValueError(
            f"{path}: expected a JSON list of records ([{{...}}, ...]), but it holds {found}; "
            f"wrap the records in a list, or write them as .jsonl (one record per line)"
        )


def hub_source(path: str, subset: str | None, split: str) -> Callable[[], Iterator[RawRow]]:
    """Rows through `datasets.load_dataset(path, name=subset, split=split)`: a hub id, or
    a local directory the `datasets` library can read. Loaded once (memory-mapped Arrow,
    so not held in RAM); each call of the returned function reads it from the start."""
    import datasets  # heavy import, only on this path

    dataset = datasets.load_dataset(path, name=subset, split=split)

    def rows() -> Iterator[RawRow]:
        for index, record in enumerate(dataset):
            yield RawRow(index, record)

    return rows


def read_hub(path: str, subset: str | None, split: str) -> Iterator[RawRow]:
    """The rows of `hub_source`, read once."""
    return hub_source(path, subset, split)()


def source_reader(spec: DatasetSpec) -> Callable[[], Iterator[RawRow]]:
    """A function reading the entry's rows from the start each time it is called:
    subsampling reads the source twice rather than holding it."""
    if spec.hub:
        return hub_source(spec.hub, spec.subset, spec.split)
    path = spec.resolved_path()
    return lambda: read_local(path)


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


def sample_positions(count: int, max_samples: int | None, seed: int) -> Sequence[int]:
    """Which of `count` rows a deterministic subsample keeps (positions among the rows
    that passed the filter, ascending, so source order is kept). It depends on the count
    alone, so a counting pass is enough to choose, without holding any row; the formula
    is the one rows were always sampled with, so a seed keeps selecting the same rows."""
    if max_samples is None or count <= max_samples:
        return range(count)
    return sorted(random.Random(seed).sample(range(count), max_samples))


def subsample(rows: Iterable[T], max_samples: int | None, seed: int) -> list[T]:
    """A deterministic subset of at most `max_samples` rows, in source order (the same
    rows `load_rows` keeps from a source whose filtered rows are `rows`)."""
    rows = list(rows)
    return [rows[i] for i in sample_positions(len(rows), max_samples, seed)]


@dataclass(frozen=True)
class LoadedRows:
    rows: list[RawRow]
    total: int  # rows in the source
    after_filter: int


def load_rows(spec: DatasetSpec) -> LoadedRows:
    """The dataset's rows: read, filtered, then subsampled (before any normalization).

    Never holds more than `max_samples` rows: a first pass counts the rows that pass the
    filter, keeping them while there are at most `max_samples`, which is all it takes
    for a source that small; when more pass, a second pass keeps the chosen positions
    (both passes must count the same rows: a source that changes in between is refused).
    Without `max_samples` every row that passes is kept, as asked."""
    keep = build_filter(spec)  # an unknown filter fails before a hub download
    read = source_reader(spec)
    first = _count_keeping_up_to(read(), keep, spec.max_samples)
    if first.holds_all:
        return LoadedRows(first.rows, first.total, first.after_filter)
    positions = sample_positions(first.after_filter, spec.max_samples, spec.seed)
    second = _pick(read(), keep, positions)
    if (second.total, second.after_filter) != (first.total, first.after_filter):
        raise RuntimeError(
            f"dataset {spec.name!r}: {spec.hub or spec.resolved_path()} changed between its "
            f"two reads ({first.total} rows, {first.after_filter} after the filter, then "
            f"{second.total} and {second.after_filter}); rerun once nothing writes to it"
        )
    return LoadedRows(second.rows, first.total, first.after_filter)


@dataclass(frozen=True)
class _Pass:
    total: int  # rows read
    after_filter: int
    rows: list[RawRow]
    holds_all: bool  # `rows` is every row that passed the filter


def _count_keeping_up_to(
    rows: Iterable[RawRow], keep: Callable[[RawRow], bool], limit: int | None
) -> _Pass:
    """Counts the rows and those passing `keep`, holding the passing ones only while
    there are at most `limit` of them (all when `limit` is None)."""
    total = after_filter = 0
    kept: list[RawRow] = []
    for row in rows:
        total += 1
        if not keep(row):
            continue
        after_filter += 1
        if limit is None or after_filter <= limit:
            kept.append(row)
        elif kept:
            kept = []  # too many to hold: the caller samples them in a second pass
    return _Pass(total, after_filter, kept, holds_all=len(kept) == after_filter)


def _pick(
    rows: Iterable[RawRow], keep: Callable[[RawRow], bool], positions: Sequence[int]
) -> _Pass:
    """The rows passing `keep` whose position among them is in `positions` (ascending).
    Reads to the end anyway, so the counts can be compared with the first pass."""
    wanted = iter(positions)
    next_wanted = next(wanted, None)
    total = after_filter = 0
    picked: list[RawRow] = []
    for row in rows:
        total += 1
        if not keep(row):
            continue
        if after_filter == next_wanted:
            picked.append(row)
            next_wanted = next(wanted, None)
        after_filter += 1
    return _Pass(total, after_filter, picked, holds_all=len(picked) == after_filter)
