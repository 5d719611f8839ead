"""The dataset registry: datasets are data (YAML), and their names are the partitions;
drafts name the datasets they are trained on."""

from mm_assets.registry.drafts import DraftSpec, SourceCap, load_drafts
from mm_assets.registry.loading import load_registry, user_registry_file
from mm_assets.registry.specs import DatasetSpec, parse_entries

__all__ = [
    "DatasetSpec",
    "DraftSpec",
    "SourceCap",
    "load_drafts",
    "load_registry",
    "parse_entries",
    "user_registry_file",
]
