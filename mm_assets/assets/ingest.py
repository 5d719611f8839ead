"""Ingest stage: the dataset's rows as loaded, and which of its images are usable."""

from collections import Counter

import dagster as dg

from mm_assets.assets.metadata import counts_table, table_links
from mm_assets.automation import materialize_on_change
from mm_assets.domain.conversations import Rejected, image_references, parse_record
from mm_assets.domain.images import DEFAULT_MAX_PIXELS, probe_reference
from mm_assets.domain.sources import load_rows
from mm_assets.partitions import dataset_partitions, dataset_spec
from mm_assets.resources import StorageResource
from mm_assets.storage import schemas

AVAILABILITY_CHECK = "image_availability_ratio"


@dg.asset(
    partitions_def=dataset_partitions,
    group_name="ingest",
    code_version="1",
    kinds={"parquet"},
)
def raw_dataset(
    context: dg.AssetExecutionContext, storage: StorageResource
) -> dg.MaterializeResult:
    """The dataset's rows as loaded (local file or hub), filtered and deterministically
    subsampled (`max_samples`, `seed`) before any normalization; keeps each row's source
    index and its original JSON."""
    spec = dataset_spec(context)
    loaded = load_rows(spec)
    rows = (
        {"source_index": r.source_index, "record": r.record_json(), "parse_error": r.parse_error}
        for r in loaded.rows
    )
    tables = storage.tables()
    written = tables.write("raw_dataset", spec.name, rows, schemas.RAW_DATASET)
    return dg.MaterializeResult(
        metadata={
            "rows": written.num_rows,
            "source_rows": loaded.total,
            "rows_after_filter": loaded.after_filter,
            "unparseable_rows": sum(r.parse_error is not None for r in loaded.rows),
            "source": spec.hub or str(spec.resolved_path()),
            **table_links(tables, "raw_dataset", spec.name),
        },
        data_version=dg.DataVersion(written.content_hash),
    )


class ImageAvailabilityConfig(dg.Config):
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    """Images declaring more pixels are refused as `too_large` (decompression bombs)."""


@dg.asset(
    partitions_def=dataset_partitions,
    automation_condition=materialize_on_change(),
    group_name="ingest",
    code_version="1",
    kinds={"parquet"},
    deps=[raw_dataset],
    check_specs=[
        dg.AssetCheckSpec(AVAILABILITY_CHECK, asset="coco_image_availability", blocking=True)
    ],
)
def coco_image_availability(
    context: dg.AssetExecutionContext, config: ImageAvailabilityConfig, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per referenced image: resolved path under the dataset's image root
    (default `$COCO_DIR`), status, width, height, format, bytes and content hash. Reads
    headers only and refuses anything resolving outside the root without opening it."""
    spec = dataset_spec(context)
    tables = storage.tables()
    referenced_by: Counter[str] = Counter()
    for row in tables.iter_rows("raw_dataset", spec.name, columns=["record", "parse_error"]):
        try:
            record = parse_record(row["record"], row["parse_error"])
        except Rejected:
            continue  # normalization quarantines it with the reason
        referenced_by.update(str(ref) for ref in image_references(record, spec.format))

    root = spec.resolved_image_root()
    probes = [
        probe_reference(root, ref, spec.image_path_strip_prefix, config.max_image_pixels)
        for ref in referenced_by
    ]
    rows = ({**p.as_row(), "referenced_by": referenced_by[p.reference]} for p in probes)
    written = tables.write("coco_image_availability", spec.name, rows, schemas.IMAGE_AVAILABILITY)

    by_status = Counter(p.status.value for p in probes)
    ok = by_status.get("ok", 0)
    ratio = ok / len(probes) if probes else 1.0
    unavailable = [p for p in probes if not p.ok]
    first = ", ".join(f"{p.reference} ({p.status.value})" for p in unavailable[:5])
    passed = ratio >= spec.min_image_availability
    description = (
        f"{ok}/{len(probes)} images usable ({ratio:.1%}); needs ≥ "
        f"{spec.min_image_availability:.0%}."
        + (
            ""
            if passed
            else f" First unavailable: {first}. Check that COCO_DIR (now {root}) holds the "
            f"images the dataset references (e.g. {root}/train2017/…), or lower "
            "min_image_availability for this dataset in the registry."
        )
    )
    return dg.MaterializeResult(
        metadata={
            "images": len(probes),
            "images_ok": ok,
            "availability_ratio": ratio,
            "images_by_status": counts_table(by_status, "status", "images"),
            "image_root": dg.MetadataValue.path(str(root)),
            **table_links(tables, "coco_image_availability", spec.name),
        },
        data_version=dg.DataVersion(written.content_hash),
        check_results=[
            dg.AssetCheckResult(
                check_name=AVAILABILITY_CHECK,
                passed=passed,
                description=description,
                metadata={"availability_ratio": ratio, "first_unavailable": first or "-"},
            )
        ],
    )
