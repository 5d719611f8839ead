"""Ingest: a registered dataset's rows into the `raw_dataset` table, and a probe of every
image they reference into `coco_image_availability` (headers only).

The source (local files or the hub) is read here, a record at a time, so memory stays
flat in its size (BENCHMARKS.md, "Raw dataset memory"); which rows are kept (filters, the
deterministic subsample) is decided in `domain/ingest/sources.py`.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import ijson
import pyarrow.parquet as pq

from mm_assets.domain.ingest.images import ImageProbe, probe_reference
from mm_assets.domain.ingest.sources import LoadedRows, RawRow, build_filter, select_rows
from mm_assets.domain.prep.conversations import Rejected, image_references, parse_record
from mm_assets.registry import DatasetSpec
from mm_assets.storage import TableStore, WrittenTable, schemas

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
logger = logging.getLogger(__name__)


def read_local(path: Path) -> Iterator[RawRow]:
    """Rows of a json (list), jsonl or parquet file, or of every such file in a directory
    (sorted by name, so the row order — and the source index — is stable)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"{path} holds no {'/'.join(LOCAL_SUFFIXES)} files")
        rows = (row for file in files for row in read_local(file))
        for index, row in enumerate(rows):
            yield RawRow(index, row.record, row.parse_error)
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
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        records = (record for batch in batches for record in batch.to_pylist())
        yield from (RawRow(index, record) for index, record in enumerate(records))
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

    ShareGPT4V ships as one such file: ijson's C backend streams it in a few MB where
    `json.loads` holds every record, faster than DuckDB's `read_json_objects` too
    (BENCHMARKS.md, "Raw dataset memory").
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

    return lambda: (RawRow(index, record) for index, record in enumerate(dataset))


def source_reader(spec: DatasetSpec) -> Callable[[], Iterator[RawRow]]:
    """A function reading the entry's rows from the start each time it is called:
    subsampling reads the source twice rather than holding it."""
    if spec.hub:
        return hub_source(spec.hub, spec.subset, spec.split)
    path = spec.resolved_path()
    return lambda: read_local(path)


def load_rows(spec: DatasetSpec) -> LoadedRows:
    """The dataset's rows: read, filtered, then subsampled (`select_rows`)."""
    keep = build_filter(spec)  # an unknown filter fails before a hub download
    loaded = select_rows(spec, keep, source_reader(spec))
    logger.info(
        "%s: %d rows in %s, %d after the filter, %d kept", spec.name, loaded.total,
        spec.hub or spec.resolved_path(), loaded.after_filter, len(loaded.rows),
    )  # fmt: skip
    return loaded


@dataclass(frozen=True)
class RawDatasetReport:
    written: WrittenTable
    source_rows: int
    rows_after_filter: int
    unparseable_rows: int
    source: str


def load_raw_dataset(spec: DatasetSpec, tables: TableStore) -> RawDatasetReport:
    """The dataset's rows as loaded, filtered and subsampled, with their source index."""
    loaded = load_rows(spec)
    rows = (
        {"source_index": r.source_index, "record": r.record_json(), "parse_error": r.parse_error}
        for r in loaded.rows
    )
    written = tables.write("raw_dataset", spec.name, rows, schemas.RAW_DATASET)
    return RawDatasetReport(
        written,
        loaded.total,
        loaded.after_filter,
        sum(r.parse_error is not None for r in loaded.rows),
        spec.hub or str(spec.resolved_path()),
    )


@dataclass(frozen=True)
class ImageAvailabilityReport:
    written: WrittenTable
    probes: list[ImageProbe]
    image_root: Path

    @property
    def by_status(self) -> Counter[str]:
        return Counter(p.status.value for p in self.probes)

    @property
    def usable(self) -> int:
        return sum(p.ok for p in self.probes)

    @property
    def ratio(self) -> float:
        """Usable share of the referenced images (1.0 when none is referenced)."""
        return self.usable / len(self.probes) if self.probes else 1.0

    def first_unavailable(self, limit: int = 5) -> list[ImageProbe]:
        return [p for p in self.probes if not p.ok][:limit]


def probe_dataset_images(
    spec: DatasetSpec, tables: TableStore, max_pixels: int
) -> ImageAvailabilityReport:
    """One probe per distinct image the partition's rows reference."""
    referenced_by: Counter[str] = Counter()
    for row in tables.iter_rows("raw_dataset", spec.name, columns=["record", "parse_error"]):
        try:
            record = parse_record(row["record"], row["parse_error"])
        except Rejected:
            continue  # normalization quarantines it with the reason
        referenced_by.update(
            str(ref) for ref in image_references(record, spec.format, spec.columns)
        )
    root = spec.resolved_image_root()
    probes = [
        probe_reference(root, ref, spec.image_path_strip_prefix, max_pixels)
        for ref in referenced_by
    ]
    rows = ({**p.as_row(), "referenced_by": referenced_by[p.reference]} for p in probes)
    written = tables.write("coco_image_availability", spec.name, rows, schemas.IMAGE_AVAILABILITY)
    return ImageAvailabilityReport(written, probes, root)
