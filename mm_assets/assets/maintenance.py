"""Upkeep of the storage root: embedded images no partition references any more.

A job, not an asset: it produces nothing, and a person runs it when they want the space
back (UI: Jobs > prune_embedded_images; CLI: `dagster job execute -m
mm_assets.definitions -j prune_embedded_images -c config.yaml`). It removes nothing
unless `apply` is set: the first run says what it would remove."""

import dagster as dg

from mm_assets.assets.resources import StorageResource


class PruneConfig(dg.Config):
    apply: bool = False
    """Remove the images; otherwise only count them."""
    min_age_hours: float = 1.0
    """Keep unreferenced images younger than this: a load running now commits its images
    before it writes its table."""


@dg.op
def prune_embedded_images_op(
    context: dg.OpExecutionContext, config: PruneConfig, storage: StorageResource
) -> None:
    """The stored images that the newest `raw_dataset` of no partition references."""
    from mm_assets.services.embedded_store import prune_embedded_images

    report = prune_embedded_images(
        storage.tables(), storage.embedded_images_dir(), config.min_age_hours * 3600, config.apply
    )
    verb = "removed" if config.apply else "would remove (set apply: true to remove)"
    context.log.info(
        f"{verb} {len(report.removed)} unreferenced images ({report.removed_bytes} bytes); "
        f"{report.referenced} referenced, {report.kept_young} unreferenced but younger "
        f"than {config.min_age_hours} h"
    )


@dg.job(description="Remove embedded images no partition's raw_dataset references.")
def prune_embedded_images() -> None:
    prune_embedded_images_op()
