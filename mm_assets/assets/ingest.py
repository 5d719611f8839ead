"""Ingest stage: the dataset's rows as loaded, and which of its images are usable."""

from typing import TYPE_CHECKING

import dagster as dg
from pydantic import Field

from mm_assets.assets.checks import has_rows, has_rows_spec
from mm_assets.assets.metadata import counts_table, rounded, table_links
from mm_assets.assets.partitions import dataset_asset, dataset_spec
from mm_assets.assets.resources import StorageResource, TargetModelResource
from mm_assets.clients.media_urls import MAX_INLINE_BYTES
from mm_assets.domain.ingest.images import DEFAULT_MAX_BYTES

if TYPE_CHECKING:
    from mm_assets.services.ingest import ImageAvailabilityReport

AVAILABILITY_CHECK = "image_availability_ratio"
NO_SOURCE_ROWS = (
    "The source gave no rows after the entry's filter: check its path (or hub id and "
    "split) and filter in the registry."
)


@dataset_asset(
    "ingest", code_version="2", check_specs=[has_rows_spec("raw_dataset", NO_SOURCE_ROWS)]
)
def raw_dataset(
    context: dg.AssetExecutionContext, storage: StorageResource
) -> dg.MaterializeResult:
    """The dataset's rows as loaded (local file or hub), filtered and deterministically
    subsampled (`max_samples`, `seed`) before any normalization; keeps each row's source
    index, file and original JSON. Images inside the rows (bytes, data URLs) are written
    once to `images/sha256/` under the storage root and referenced as `sha256:<hex>`
    (`embedded_images`: seen in the kept rows, distinct, files written now)."""
    from mm_assets.services.ingest import load_raw_dataset

    tables = storage.tables()
    report = load_raw_dataset(dataset_spec(context), tables, storage.embedded_images_dir())
    return dg.MaterializeResult(
        metadata={
            "rows": report.written.num_rows,
            "source_rows": report.source_rows,
            "rows_after_filter": report.rows_after_filter,
            "unparseable_rows": report.unparseable_rows,
            "source": report.source,
            "embedded_images": {
                "seen": report.embedded_images,
                "distinct": report.embedded_distinct,
                "written": report.embedded_written,
            },
            **table_links(tables, "raw_dataset", context.partition_key),
        },
        data_version=dg.DataVersion(report.written.content_hash),
        check_results=[has_rows(report.written.num_rows, NO_SOURCE_ROWS)],
    )


class ImageAvailabilityConfig(dg.Config):
    max_image_pixels: int | None = None
    """Images declaring more pixels are refused as `too_large` (vLLM decodes each whole
    before the processor scales it down). Default: 32 x the target processor's
    `max_pixels`, at most Pillow's bomb threshold (89.5 MP)."""
    max_image_bytes: int = Field(default=DEFAULT_MAX_BYTES, ge=1, le=MAX_INLINE_BYTES)
    """Image files larger than this are refused as `too_large`, before anything reads
    them (vLLM would read each whole, per request); at most 256 MiB, what a request
    carries inline."""


@dataset_asset(
    "ingest",
    code_version="3",
    deps=[raw_dataset],
    check_specs=[
        dg.AssetCheckSpec(
            AVAILABILITY_CHECK,
            asset="coco_image_availability",
            blocking=True,
            description="Fails when fewer of the referenced images are usable than the "
            "entry's min_image_availability: rows whose images are missing are dropped, "
            "and a wrong image root drops them all. If it fails: point COCO_DIR (or the "
            "entry's image_root) at the images, or lower min_image_availability.",
        )
    ],
)
def coco_image_availability(
    context: dg.AssetExecutionContext,
    config: ImageAvailabilityConfig,
    storage: StorageResource,
    target_model: TargetModelResource,
) -> dg.MaterializeResult:
    """One row per referenced image: resolved path under the dataset's image root
    (default `$COCO_DIR`) — or, for an image that was inside the rows (`sha256:<hex>`),
    its file under the storage root's `images/sha256/` — status, width, height, format,
    bytes and content hash. Reads headers only and refuses anything resolving outside the
    root without opening it."""
    from mm_assets.services.ingest import pixel_cap, probe_dataset_images

    spec, tables = dataset_spec(context), storage.tables()
    max_pixels, cap_source = pixel_cap(config.max_image_pixels, target_model.model())
    embedded, max_bytes = storage.embedded_images_dir(), config.max_image_bytes
    report = probe_dataset_images(spec, tables, max_pixels, embedded, max_bytes)
    return dg.MaterializeResult(
        metadata=rounded(
            {
                "images": len(report.probes),
                "images_ok": report.usable,
                "availability_ratio": report.ratio,
                "images_by_status": counts_table(report.by_status, "status", "images"),
                "image_root": dg.MetadataValue.path(str(report.image_root)),
                "embedded_images_dir": dg.MetadataValue.path(str(report.embedded_dir)),
                "max_image_pixels": max_pixels,
                "max_image_pixels_from": cap_source,
                **table_links(tables, "coco_image_availability", spec.name),
            }
        ),
        data_version=dg.DataVersion(report.written.content_hash),
        check_results=[availability_check(report, spec.min_image_availability)],
    )


def availability_check(report: "ImageAvailabilityReport", minimum: float) -> dg.AssetCheckResult:
    """Passes when enough images are usable; says where the images were looked for."""
    first = ", ".join(f"{p.reference} ({p.status.value})" for p in report.first_unavailable())
    passed, root = report.ratio >= minimum, report.image_root
    description = (
        f"{report.usable}/{len(report.probes)} images usable ({report.ratio:.1%}); needs ≥ "
        f"{minimum:.0%}."
    )
    if not passed:
        description += (
            f" First unavailable: {first}. Check that COCO_DIR (now {root}) holds the images "
            f"the dataset references (e.g. {root}/train2017/…), or lower "
            "min_image_availability for this dataset in the registry. Images that were "
            f"inside the rows (sha256:…) are under {report.embedded_dir}."
        )
    return dg.AssetCheckResult(
        check_name=AVAILABILITY_CHECK,
        passed=passed,
        description=description,
        metadata=rounded({"availability_ratio": report.ratio, "first_unavailable": first or "-"}),
    )
