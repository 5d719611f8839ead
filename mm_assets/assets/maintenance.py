"""Upkeep of the storage root: embedded images nothing references any more.

A job, not an asset: it produces nothing, and a person runs it when they want the space
back (UI: Jobs > prune_embedded_images > Launchpad; CLI: `dagster job execute -m
mm_assets.definitions -j prune_embedded_images -c config.yaml`, the config holding
`ops: {prune_embedded_images_op: {config: {apply: true}}}`). It removes nothing unless
`apply` is set: the first run says what it would remove. What makes a removal safe is in
`services/embedded_store.py`."""

import dagster as dg
from pydantic import field_validator

from mm_assets.assets.resources import StorageResource


class PruneConfig(dg.Config):
    apply: bool = False
    """Remove the images; otherwise only count them."""
    min_age_hours: float = 1.0
    """Keep unreferenced images younger than this (at least 1): a load commits its images
    (each given a fresh mtime) before it writes the table that names them."""

    @field_validator("min_age_hours")
    @classmethod
    def _at_least_an_hour(cls, hours: float) -> float:
        if not hours >= 1:
            raise ValueError(
                f"min_age_hours={hours}: use at least 1, or the images a running load has "
                "just committed, before its table names them, would be removed"
            )
        return hours


@dg.op
def prune_embedded_images_op(
    context: dg.OpExecutionContext, config: PruneConfig, storage: StorageResource
) -> None:
    """The stored images that no table and no load in flight references."""
    from mm_assets.services.embedded_store import prune_embedded_images

    report = prune_embedded_images(
        storage.tables(), storage.embedded_images_dir(), config.min_age_hours * 3600, config.apply
    )
    verb = "removed" if config.apply else "would remove (set apply: true to remove)"
    context.log.info(
        f"{verb} {len(report.removed)} unreferenced images ({report.removed_bytes} bytes); "
        f"{report.referenced} referenced, {report.kept_young} unreferenced but younger "
        f"than {config.min_age_hours} h, {report.kept_referenced_again} referenced again "
        "before their removal"
    )
    if report.refused:
        raise dg.Failure(description=report.refused)


@dg.job(description="Remove embedded images no table and no running load references.")
def prune_embedded_images() -> None:
    prune_embedded_images_op()
