"""Ingest: a registered dataset's rows into the `raw_dataset` table, and a probe of every
image they reference into `coco_image_availability` (headers only)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mm_assets.domain.ingest.images import ImageProbe, probe_reference
from mm_assets.domain.ingest.sources import load_rows
from mm_assets.domain.prep.conversations import Rejected, image_references, parse_record
from mm_assets.registry import DatasetSpec
from mm_assets.storage import TableStore, WrittenTable, schemas


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
        referenced_by.update(str(ref) for ref in image_references(record, spec.format))
    root = spec.resolved_image_root()
    probes = [
        probe_reference(root, ref, spec.image_path_strip_prefix, max_pixels)
        for ref in referenced_by
    ]
    rows = ({**p.as_row(), "referenced_by": referenced_by[p.reference]} for p in probes)
    written = tables.write("coco_image_availability", spec.name, rows, schemas.IMAGE_AVAILABILITY)
    return ImageAvailabilityReport(written, probes, root)
