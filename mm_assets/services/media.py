"""The one directory vLLM may read a partition's images from.

vLLM reads `file://` images only under `--allowed-local-media-path`, a single directory.
A partition's usable images lie under its image root (referenced files), in the
embedded-image directory under the storage root (images that were inside the rows,
`sha256:<hex>`), or in both; the availability table says which, so a text-only partition
opens no directory at all.
"""

from __future__ import annotations

import os
from pathlib import Path

from mm_assets.domain.ingest.embedded_images import embedded_images_dir, is_embedded_reference
from mm_assets.domain.ingest.images import ImageStatus
from mm_assets.registry import DatasetSpec
from mm_assets.storage import TableStore


def media_root(spec: DatasetSpec, tables: TableStore, storage_root: Path | str) -> Path | None:
    """The image root when the partition's usable images are referenced files, the
    embedded-image directory when they were inside the rows, their common parent when
    both, None when it has no usable image. Before its images are probed (no
    availability table in this store), the entry's image root, as for any dataset."""
    if not tables.exists("coco_image_availability", spec.name):
        return spec.resolved_image_root()
    embedded = files = False
    rows = tables.iter_rows("coco_image_availability", spec.name, columns=["reference", "status"])
    for row in rows:
        if row["status"] != ImageStatus.OK:
            continue  # never sent to vLLM
        if is_embedded_reference(row["reference"]):
            embedded = True
        else:
            files = True
        if embedded and files:
            break
    roots = [spec.resolved_image_root()] * files + [
        embedded_images_dir(Path(storage_root))
    ] * embedded
    return common_root(roots)


def common_root(roots: list[Path]) -> Path | None:
    """The deepest directory holding all of `roots` (None for none)."""
    if not roots:
        return None
    return Path(os.path.commonpath(sorted(str(Path(r).resolve()) for r in roots)))


def sources_media_root(
    specs: list[DatasetSpec], tables: TableStore, storage_root: Path | str
) -> Path | None:
    """The directory vLLM may read a draft's images under: each source's `media_root`
    (their common parent when there are several)."""
    roots = [media_root(spec, tables, storage_root) for spec in specs]
    return common_root([r for r in roots if r is not None])
