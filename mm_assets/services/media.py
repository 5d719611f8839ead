"""The one directory vLLM opens a step's image files under (`--allowed-local-media-path`).

It is never widened to hold both a partition's image root and the embedded-image
directory: it is the image root when the partition references files, else the
embedded-image directory, and the client sends any image outside it inline
(`clients/media_urls.py`). A text-only partition opens no directory at all.
"""

from __future__ import annotations

from pathlib import Path

from mm_assets.domain.ingest.embedded_images import embedded_images_dir, is_embedded_reference
from mm_assets.domain.ingest.images import ImageStatus
from mm_assets.registry import DatasetSpec
from mm_assets.storage import TableStore


def media_root(spec: DatasetSpec, tables: TableStore, storage_root: Path | str) -> Path | None:
    """The partition's directory (see the module's docstring), from its probes; None when
    it has no usable image. Before its images are probed, the entry's image root."""
    if not tables.exists("coco_image_availability", spec.name):
        return spec.resolved_image_root()
    embedded = False
    rows = tables.iter_rows("coco_image_availability", spec.name, columns=["reference", "status"])
    for row in rows:
        if row["status"] != ImageStatus.OK:
            continue  # never sent to vLLM
        if not is_embedded_reference(row["reference"]):
            return spec.resolved_image_root()
        embedded = True
    return embedded_images_dir(Path(storage_root)).resolve() if embedded else None


def sources_media_root(
    specs: list[DatasetSpec], tables: TableStore, storage_root: Path | str
) -> Path | None:
    """The directory vLLM opens a draft's image files under: the first source's
    `media_root` (the other sources' images, when they lie elsewhere, go inline)."""
    roots = (media_root(spec, tables, storage_root) for spec in specs)
    return next((root for root in roots if root is not None), None)
