"""The dataset registry: datasets are data (YAML), and their names are the partitions."""

from mm_assets.registry.specs import DatasetSpec, load_registry

__all__ = ["DatasetSpec", "load_registry"]
