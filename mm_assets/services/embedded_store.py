"""Removing the embedded images that no dataset references any more.

An image taken out of a row is written once, by content, and shared by every partition
whose rows held it. A partition loaded again with other rows (a new filter, seed or
source) leaves behind the images of the rows it no longer keeps, and nothing else
removes them. `prune_embedded_images` removes the stored images that the newest
`raw_dataset` of no partition references. A fresh image is kept for `min_age_s`
anyway: a load running now commits its images before it writes its table.
`python -m mm_assets.orchestration prune-images` runs it (a dry run unless `--apply`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from mm_assets.domain.ingest.embedded_images import embedded_image_path
from mm_assets.storage import TableStore

_REFERENCED = (
    "SELECT DISTINCT unnest(regexp_extract_all(record, 'sha256:([0-9a-f]{64})', 1)) "
    "FROM raw_dataset"
)


@dataclass
class PruneReport:
    removed: list[Path] = field(default_factory=list)
    removed_bytes: int = 0
    kept_young: int = 0  # unreferenced, but too fresh to be sure
    referenced: int = 0


def referenced_digests(tables: TableStore) -> set[str]:
    """Digests of the embedded images that a partition's newest `raw_dataset` names."""
    if "raw_dataset" not in tables.table_names():
        return set()
    with tables.connect() as con:
        return {digest for (digest,) in con.execute(_REFERENCED).fetchall()}


def prune_embedded_images(
    tables: TableStore, embedded_dir: Path, min_age_s: float = 3600.0, apply: bool = False
) -> PruneReport:
    """The stored images no partition references, older than `min_age_s`: removed with
    `apply`, only listed without it."""
    referenced = referenced_digests(tables)
    report = PruneReport(referenced=len(referenced))
    cutoff = time.time() - min_age_s
    for path in sorted(embedded_dir.glob("??/*")):
        if path.name in referenced or path != embedded_image_path(embedded_dir, path.name):
            continue
        stat = path.lstat()
        if stat.st_mtime > cutoff:
            report.kept_young += 1
            continue
        report.removed.append(path)
        report.removed_bytes += stat.st_size
        if apply:
            path.unlink(missing_ok=True)
    return report
