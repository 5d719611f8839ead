"""Ingest: a registered dataset's rows into the `raw_dataset` table, and a probe of every
image they reference into `coco_image_availability` (headers only).

The source (local files or the hub) is read here, a record at a time, so memory stays
flat in its size (BENCHMARKS.md, "Raw dataset memory"); which rows are kept (filters, the
deterministic subsample) is decided in `domain/ingest/sources.py`.

Images kept inside the rows (`domain/ingest/embedded_images.py`) are taken out as each row
is read and written once to the content-addressed directory under the storage root, so
no table holds pixels and no row holds its image's bytes past its read. They are written
for every row read, before the subsample chooses: a subsampled source writes the images
of rows it then leaves out (writes are idempotent, so its second read writes nothing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import ijson
import pyarrow.parquet as pq

from mm_assets.common.files import atomic_path, remove_stale_temporaries
from mm_assets.domain.ingest.embedded_images import (
    IMAGE_KEYS,
    embedded_image_path,
    embedded_references,
    extract_embedded_images,
)
from mm_assets.domain.ingest.images import DEFAULT_MAX_BYTES, ImageProbe, probe_reference
from mm_assets.domain.ingest.sources import LoadedRows, RawRow, build_filter, select_rows
from mm_assets.domain.prep.conversations import Rejected, image_references, parse_record
from mm_assets.registry import DatasetSpec
from mm_assets.storage import TableStore, WrittenTable, schemas

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
logger = logging.getLogger(__name__)


def read_local(path: Path, data_files: list[str] | None = None) -> Iterator[RawRow]:
    """Rows of a json (list), jsonl or parquet file, or of every such file in a directory
    (sorted by name, so the row order — and the source index — is stable), or of the
    directory's `data_files` only, in their listed order. Each row names its file."""
    if path.is_dir():
        files = _listed_files(path, data_files) if data_files else _all_files(path)
        rows = (
            RawRow(0, row.record, row.parse_error, file.relative_to(path).as_posix())
            for file in files
            for row in _read_file(file)
        )
        for index, row in enumerate(rows):
            yield RawRow(index, row.record, row.parse_error, row.source_file)
        return
    if data_files:
        raise ValueError(
            f"{path} is a file, and 'data_files' chooses files under a directory: set "
            f"'path' to the directory holding {data_files[0]!r}, or remove 'data_files'"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset file {path} does not exist; fix the entry's 'path' in the registry "
            f"(for the demo datasets run `python -m mm_assets.demo build`)"
        )
    for row in _read_file(path):
        yield RawRow(row.source_index, row.record, row.parse_error, path.name)


def _all_files(directory: Path) -> list[Path]:
    found = sorted(p for p in directory.rglob("*") if p.suffix in LOCAL_SUFFIXES)
    files = [p for p in found if _inside(p, directory)]
    for escaped in sorted(set(found) - set(files)):
        logger.warning("not read: %s links outside the dataset's path %s", escaped, directory)
    if not files:
        raise FileNotFoundError(f"{directory} holds no {'/'.join(LOCAL_SUFFIXES)} files")
    return files


def _listed_files(directory: Path, data_files: list[str]) -> list[Path]:
    """The entry's `data_files` under `directory`, in their order (a glob pattern gives
    its matches sorted by name); each must exist, or the load stops naming it."""
    files: list[Path] = []
    for entry in data_files:
        if Path(entry).is_absolute():
            raise ValueError(
                f"data_files entry {entry!r} is absolute: data_files are relative to the "
                f"entry's 'path' ({directory}); set 'path' to the directory that holds it"
            )
        matches = (
            sorted(p for p in directory.glob(entry) if p.is_file())
            if any(c in entry for c in "*?[")
            else [directory / entry]
            if (directory / entry).is_file()
            else []
        )
        if not matches:
            raise FileNotFoundError(
                f"data_files entry {entry!r} names no file under {directory}; fix the entry's "
                f"'data_files' in the registry (paths relative to its 'path')"
            )
        outside = [m for m in matches if not _inside(m, directory)]
        if outside:
            raise ValueError(
                f"data_files entry {entry!r} reaches {outside[0].resolve()}, outside the "
                f"entry's 'path' {directory}: list files under it (no '..', no link out)"
            )
        files += matches
    return files


def _inside(file: Path, directory: Path) -> bool:
    """Whether `file`, its links and `..` resolved, lies under `directory`'s real path."""
    return file.resolve().is_relative_to(directory.resolve())


def _read_file(path: Path) -> Iterator[RawRow]:
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix == ".json":
        yield from _read_json_list(path)
    elif path.suffix == ".parquet":
        # small batches: a batch of rows with embedded images holds all their bytes
        batches = pq.ParquetFile(path).iter_batches(batch_size=64)
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


def hub_source(
    path: str, subset: str | None, split: str, data_files: list[str] | None = None
) -> Callable[[], Iterator[RawRow]]:
    """Rows through `datasets.load_dataset(path, name=subset, split=split)`: a hub id, or
    a local directory the `datasets` library can read. Loaded once (memory-mapped Arrow,
    so not held in RAM); each call of the returned function reads it from the start.

    With `data_files`, each file is loaded on its own, in the listed order, so each row
    knows its file (`RawRow.source_file`). Image columns are read undecoded
    (`undecoded_images`): rows give the image's bytes, never PIL pixels."""
    import datasets  # heavy import, only on this path

    def load(files: str | None) -> datasets.Dataset:
        # a file given as {split: file} is read into the split asked for
        chosen = {"data_files": {split: files}} if files is not None else {}
        return undecoded_images(datasets.load_dataset(path, name=subset, split=split, **chosen))

    parts = [(file, load(file)) for file in data_files] if data_files else [(None, load(None))]

    def read() -> Iterator[RawRow]:
        rows = ((file, record) for file, dataset in parts for record in dataset)
        return (RawRow(index, record, None, file) for index, (file, record) in enumerate(rows))

    return read


def undecoded_images(dataset: Any) -> Any:
    """`dataset` with every `datasets.Image` column (alone, in a list or in a struct) cast
    to `Image(decode=False)`, so iteration gives `{bytes, path}` dicts: decoding every
    image to pixels would cost time and memory for nothing, as only the bytes are kept."""
    for name, feature in dataset.features.items():
        undecoded = _undecoded(feature)
        if undecoded != feature:
            dataset = dataset.cast_column(name, undecoded)
    return dataset


def _undecoded(feature: Any) -> Any:
    import datasets

    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False)
    if isinstance(feature, dict):
        return {key: _undecoded(value) for key, value in feature.items()}
    if isinstance(feature, list | tuple) and len(feature) == 1:
        return [_undecoded(feature[0])]
    if dataclasses.is_dataclass(feature) and hasattr(feature, "feature"):  # List, LargeList
        return dataclasses.replace(feature, feature=_undecoded(feature.feature))
    return feature


class EmbeddedImageWriter:
    """Takes the images out of each row read and writes each once into the embedded-image
    directory (`<hex[:2]>/<hex>`, by temporary name and rename, skipped when present)."""

    def __init__(self, directory: Path, image_keys: frozenset[str] = IMAGE_KEYS) -> None:
        self.directory, self.image_keys = directory, image_keys
        self.written = 0  # files created by this load
        self._swept: set[Path] = set()

    def take(self, row: RawRow) -> RawRow:
        if row.parse_error is not None:
            return row
        found = extract_embedded_images(row.record, self.image_keys)
        for digest, data in found.images.items():
            self._put(digest, data)
        return RawRow(row.source_index, found.record, None, row.source_file)

    def _put(self, digest: str, data: bytes) -> None:
        final = embedded_image_path(self.directory, digest)
        if final.is_file():
            return
        if final.parent not in self._swept:  # once per directory, not per image
            remove_stale_temporaries(final.parent)
            self._swept.add(final.parent)
        with atomic_path(final, len(data), sweep=False) as tmp:
            tmp.write_bytes(data)
        self.written += 1


def source_reader(
    spec: DatasetSpec, images: EmbeddedImageWriter | None = None
) -> Callable[[], Iterator[RawRow]]:
    """A function reading the entry's rows from the start each time it is called:
    subsampling reads the source twice rather than holding it. With `images`, every
    row's embedded images are written out and replaced by their references as it is read."""
    if spec.hub:
        read = hub_source(spec.hub, spec.subset, spec.split, spec.data_files)
    else:
        read = partial(read_local, spec.resolved_path(), spec.data_files)
    if images is None:
        return read
    return lambda: (images.take(row) for row in read())


def load_rows(spec: DatasetSpec, images: EmbeddedImageWriter | None = None) -> LoadedRows:
    """The dataset's rows: read, filtered, then subsampled (`select_rows`); with `images`,
    their embedded images written out (`source_reader`)."""
    keep = build_filter(spec)  # an unknown filter fails before a hub download
    loaded = select_rows(spec, keep, source_reader(spec, images))
    logger.info(
        "%s: %d rows in %s, %d after the filter, %d kept",
        spec.name,
        loaded.total,
        spec.hub or spec.resolved_path(),
        loaded.after_filter,
        len(loaded.rows),
    )
    return loaded


@dataclass(frozen=True)
class RawDatasetReport:
    written: WrittenTable
    source_rows: int
    rows_after_filter: int
    unparseable_rows: int
    source: str
    embedded_images: int = 0  # references to embedded images in the kept rows
    embedded_distinct: int = 0  # distinct images among them
    embedded_written: int = 0  # image files this load created (the others were there)


def load_raw_dataset(spec: DatasetSpec, tables: TableStore, embedded_dir: Path) -> RawDatasetReport:
    """The dataset's rows as loaded, filtered and subsampled, with their source index and
    file; images inside the rows are written to `embedded_dir` and referenced by hash."""
    configured = {spec.columns.image} if spec.columns.image else set()
    images = EmbeddedImageWriter(embedded_dir, IMAGE_KEYS | configured)
    loaded = load_rows(spec, images)
    references = Counter(ref for r in loaded.rows for ref in embedded_references(r.record))
    rows = (
        {
            "source_index": r.source_index,
            "record": r.record_json(),
            "parse_error": r.parse_error,
            "source_file": r.source_file,
        }
        for r in loaded.rows
    )
    written = tables.write("raw_dataset", spec.name, rows, schemas.RAW_DATASET)
    return RawDatasetReport(
        written,
        loaded.total,
        loaded.after_filter,
        sum(r.parse_error is not None for r in loaded.rows),
        spec.hub or str(spec.resolved_path()),
        references.total(),
        len(references),
        images.written,
    )


@dataclass(frozen=True)
class ImageAvailabilityReport:
    written: WrittenTable
    probes: list[ImageProbe]
    image_root: Path
    embedded_dir: Path

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
    spec: DatasetSpec,
    tables: TableStore,
    max_pixels: int,
    embedded_dir: Path,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ImageAvailabilityReport:
    """One probe per distinct image the partition's rows reference: a file under the image
    root, or an embedded image (`sha256:<hex>`) in `embedded_dir`."""
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
        probe_reference(
            root, ref, spec.image_path_strip_prefix, max_pixels, embedded_dir, max_bytes
        )
        for ref in referenced_by
    ]
    rows = ({**p.as_row(), "referenced_by": referenced_by[p.reference]} for p in probes)
    written = tables.write("coco_image_availability", spec.name, rows, schemas.IMAGE_AVAILABILITY)
    return ImageAvailabilityReport(written, probes, root, embedded_dir)
