"""The dataset registry: datasets are data (YAML), and their names are the partitions."""

from mm_assets.registry.specs import DatasetSpec, load_registry, parse_entries, user_registry_file

__all__ = ["DatasetSpec", "load_registry", "parse_entries", "user_registry_file"]
