"""Ingest: a registered dataset's rows into the `raw_dataset` table, and a probe of every
image they reference into `coco_image_availability` (headers only).

The source (local files, `local_files.py`, or the hub) is read a record at a time, each
kept row written as it comes, so memory stays flat in the source's size (BENCHMARKS.md,
"Raw dataset memory"); which rows are kept is decided in `domain/ingest/sources.py`.
Images inside the rows are taken out of each kept row and written once to the
content-addressed directory under the storage root, so no table holds pixels.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from mm_assets.common.files import (
    atomic_path,
    fsync_path,
    make_dirs,
    remove_stale_temporaries,
)
from mm_assets.domain.ingest.embedded_images import (
    IMAGE_KEYS,
    embedded_image_path,
    embedded_references,
    extract_embedded_images,
)
from mm_assets.domain.ingest.images import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_PIXELS,
    PROCESSOR_PIXELS_MULTIPLE,
    ImageProbe,
    pixel_cap_for,
    probe_reference,
)
from mm_assets.domain.ingest.sources import (
    RawRow,
    RowSink,
    Selection,
    build_filter,
    checked,
    select_rows,
)
from mm_assets.domain.prep.conversations import Rejected, image_references, parse_record
from mm_assets.registry import DatasetSpec
from mm_assets.services.embedded_store import new_staging_dir, store_lock
from mm_assets.services.local_files import read_local
from mm_assets.services.target import TargetModel
from mm_assets.storage import TableStore, WrittenTable, schemas
from mm_assets.storage.tables import BatchWriter

logger = logging.getLogger(__name__)


def hub_source(
    path: str, subset: str | None, split: str, data_files: list[str] | None = None
) -> Callable[[], Iterator[RawRow]]:
    """Rows through `datasets.load_dataset` (a hub id, or a local directory it reads),
    loaded once (memory-mapped); each call of the returned function reads from the start.
    With `data_files`, each file is loaded on its own, in order, so each row knows its
    file. Image columns are read undecoded: rows give the image's bytes, never pixels."""
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
    """`dataset` with every `datasets.Image` column (alone, in a list or a struct) cast to
    `Image(decode=False)`: only the bytes are kept, so decoding pixels would be waste."""
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
    """Takes the images out of each row the selection keeps. Every image the load
    references is staged in this load's own directory, a new one as a file, a stored one
    as a hard link (so `prune_embedded_images` sees it referenced, and a removal that
    raced the check leaves the link), until `commit` moves them into the store;
    `discard` drops them. The next load removes a killed load's staging directory."""

    def __init__(self, directory: Path, image_keys: frozenset[str] = IMAGE_KEYS) -> None:
        self.directory, self.image_keys = directory, image_keys
        self.written = 0  # files created by this load
        self.staging = new_staging_dir(directory)
        self._staged: set[str] = set()

    def take(self, row: RawRow) -> RawRow:
        if row.parse_error is not None:
            return row
        found = extract_embedded_images(row.record, self.image_keys)
        for digest, data in found.images.items():
            self._stage(digest, data)
        return RawRow(row.source_index, found.record, None, row.source_file)

    def _stage(self, digest: str, data: bytes) -> None:
        if digest in self._staged:
            return
        if not self._staged:
            remove_stale_temporaries(self.staging.parent)
            make_dirs(self.staging)
        if not _link_stored(embedded_image_path(self.directory, digest), self.staging / digest):
            with atomic_path(self.staging / digest, len(data), sweep=False) as tmp:
                tmp.write_bytes(data)
        self._staged.add(digest)

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self._staged.clear()

    def commit(self) -> None:
        """The staged images into the store, each by one rename, each given a fresh mtime:
        young, it outlives a prune until the table naming it is written."""
        with store_lock(self.directory, exclusive=False):
            for digest in sorted(self._staged):
                final = embedded_image_path(self.directory, digest)
                new = not final.is_file()
                make_dirs(final.parent)
                os.replace(self.staging / digest, final)
                os.utime(final)
                if new:
                    fsync_path(final.parent)
                    self.written += 1
            self.discard()


def _link_stored(stored: Path, staged: Path) -> bool:
    """Whether a plain stored file could be hard-linked as `staged` (else the caller
    writes the bytes)."""
    try:
        if not stat.S_ISREG(stored.lstat().st_mode):
            return False
        os.link(stored, staged, follow_symlinks=False)
    except OSError:
        return False
    return True


def source_reader(spec: DatasetSpec) -> Callable[[], Iterator[RawRow]]:
    """A function reading the entry's rows from the start at each call (subsampling reads
    the source twice rather than holding it), each row `checked`."""
    if spec.hub:
        read = hub_source(spec.hub, spec.subset, spec.split, spec.data_files)
    else:
        read = partial(read_local, spec.resolved_path(), spec.data_files)
    return lambda: map(checked, read())


def load_rows(spec: DatasetSpec, sink: RowSink) -> Selection:
    """The dataset's rows, read, filtered, then subsampled (`select_rows`), into `sink`."""
    keep = build_filter(spec)  # an unknown filter fails before a hub download
    selected = select_rows(spec, keep, source_reader(spec), sink)
    logger.info(
        "%s: %d rows in %s, %d after the filter, %d kept",
        spec.name,
        selected.total,
        spec.hub or spec.resolved_path(),
        selected.after_filter,
        selected.kept,
    )
    return selected


class RawTableSink:
    """Each kept row, its images taken out, into the table's writer (`RowSink`), counted;
    `discard` starts both over."""

    def __init__(self, out: BatchWriter, images: EmbeddedImageWriter) -> None:
        self.out, self.images = out, images
        self.references: Counter[str] = Counter()
        self.unparseable = 0

    def take(self, row: RawRow) -> None:
        row = self.images.take(row)
        self.references.update(embedded_references(row.record))
        self.unparseable += row.parse_error is not None
        self.out.write(
            {
                "source_index": row.source_index,
                "record": row.record_json(),
                "parse_error": row.parse_error,
                "source_file": row.source_file,
            }
        )

    def discard(self) -> None:
        self.images.discard()
        self.out.discard()
        self.references.clear()
        self.unparseable = 0


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
    """The dataset's kept rows, with their source index and file; images inside them
    written to `embedded_dir` and referenced by hash (committed before the table)."""
    configured = {spec.columns.image} if spec.columns.image else set()
    images = EmbeddedImageWriter(embedded_dir, IMAGE_KEYS | configured)
    with tables.writer("raw_dataset", spec.name, schemas.RAW_DATASET) as out:
        sink = RawTableSink(out, images)
        selected = load_rows(spec, sink)
        images.commit()
    assert out.result is not None
    return RawDatasetReport(
        out.result,
        selected.total,
        selected.after_filter,
        sink.unparseable,
        spec.hub or str(spec.resolved_path()),
        sink.references.total(),
        len(sink.references),
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


def pixel_cap(setting: int | None, target: TargetModel) -> tuple[int, str]:
    """The probe's pixel cap and where it came from: the setting, else `pixel_cap_for`
    the target processor's `max_pixels` (only its config is read: ingest must not
    download a model); a processor that does not load gets Pillow's bomb threshold."""
    if setting is not None:
        return setting, "max_image_pixels (set)"
    try:
        pixels = target.image_processor_max_pixels()
    except (OSError, ValueError) as exc:
        return DEFAULT_MAX_PIXELS, f"Pillow's threshold: the target's image processor: {exc}"
    if pixels is None:
        return DEFAULT_MAX_PIXELS, "Pillow's threshold: the target's processor has no max_pixels"
    return pixel_cap_for(pixels), f"{PROCESSOR_PIXELS_MULTIPLE} x the target's max_pixels {pixels}"


def probe_dataset_images(
    spec: DatasetSpec,
    tables: TableStore,
    max_pixels: int,
    embedded_dir: Path,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ImageAvailabilityReport:
    """One probe per distinct image the rows reference (a file under the image root, or
    `sha256:<hex>` in `embedded_dir`)."""
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
