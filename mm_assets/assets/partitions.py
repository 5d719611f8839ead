"""One partition per registered dataset."""

from __future__ import annotations

import dagster as dg

from mm_assets.registry import DatasetSpec, load_registry

REGISTRY = load_registry()
dataset_partitions = dg.StaticPartitionsDefinition(sorted(REGISTRY))


def dataset_spec(context: dg.AssetExecutionContext) -> DatasetSpec:
    return REGISTRY[context.partition_key]
