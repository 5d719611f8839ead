"""Refreshing the raw datasets on a schedule; automation carries real changes downstream.

Only datasets that were materialized before are refreshed (a registry preset nobody has
loaded is never downloaded behind the user's back). A refresh that reads the same rows
writes the same data version, so nothing downstream runs; a changed dataset flows through
its own partition's chain only (see `mm_assets.assets.automation`).
"""

from __future__ import annotations

import os

import dagster as dg

from mm_assets.assets.ingest import raw_dataset
from mm_assets.assets.partitions import dataset_partitions

refresh_raw_datasets_job = dg.define_asset_job("refresh_raw_datasets", selection=[raw_dataset])


@dg.schedule(
    job=refresh_raw_datasets_job,
    cron_schedule=os.environ.get("MM_ASSETS_REFRESH_CRON", "0 3 * * *"),
    default_status=dg.DefaultScheduleStatus.RUNNING,
)
def refresh_raw_datasets(context: dg.ScheduleEvaluationContext) -> list[dg.RunRequest]:
    """Re-read every dataset already loaded, one run per partition."""
    loaded = context.instance.get_materialized_partitions(raw_dataset.key)
    return [
        dg.RunRequest(
            run_key=f"{key}:{context.scheduled_execution_time:%Y%m%dT%H%M}", partition_key=key
        )
        for key in sorted(loaded & set(dataset_partitions.get_partition_keys()))
    ]
