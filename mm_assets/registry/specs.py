"""Dataset entries read from the built-in YAML and an optional user YAML file."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from mm_assets import settings

BUILTIN_FILE = "datasets.yaml"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_KNOWN_KEYS = {
    "hub",
    "path",
    "subset",
    "split",
    "format",
    "filter",
    "image_root",
    "image_path_strip_prefix",
    "max_samples",
    "seed",
    "min_image_availability",
}


@dataclass(frozen=True)
class DatasetSpec:
    """One registered dataset: where its rows come from and how to read them."""

    name: str
    format: str
    hub: str | None = None
    path: str | None = None
    subset: str | None = None
    split: str = "train"
    filter: dict[str, Any] = field(default_factory=dict)
    image_root: str | None = None
    image_path_strip_prefix: str = ""
    max_samples: int | None = None
    seed: int = 0
    min_image_availability: float = 0.95

    def resolved_image_root(self) -> Path:
        """The directory image references resolve under: the entry's, else `$COCO_DIR`."""
        root = self.image_root or os.environ.get("COCO_DIR") or str(settings.home() / "coco")
        return Path(_expand(root)).expanduser().resolve()

    def resolved_path(self) -> Path:
        if self.path is None:
            raise ValueError(f"dataset {self.name!r} has no local path (it is a hub dataset)")
        return Path(_expand(self.path)).expanduser()


def _expand(value: str) -> str:
    env = dict(os.environ)
    env.setdefault("MM_ASSETS_HOME", str(settings.home()))
    return re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), m.group(0)), value)


def parse_entries(entries: dict[str, Any], origin: str) -> dict[str, DatasetSpec]:
    """Validate raw YAML entries; errors name the file and the entry to fix."""
    if not isinstance(entries, dict):
        raise ValueError(f"{origin}: expected a mapping of dataset name -> entry")
    specs: dict[str, DatasetSpec] = {}
    for name, entry in entries.items():
        where = f"{origin}: dataset {name!r}"
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}: names may hold letters, digits, '_', '-' and '.'")
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping of keys, got {type(entry).__name__}")
        unknown = set(entry) - _KNOWN_KEYS
        if unknown:
            raise ValueError(
                f"{where}: unknown keys {sorted(unknown)}; known: {sorted(_KNOWN_KEYS)}"
            )
        if ("hub" in entry) == ("path" in entry):
            raise ValueError(f"{where}: give exactly one of 'hub' (a hub id) or 'path'")
        if "format" not in entry:
            raise ValueError(f"{where}: 'format' is required (sharegpt4v, sharegpt, messages)")
        specs[name] = DatasetSpec(name=name, **entry)
    return specs


def user_registry_file() -> Path:
    return Path(
        os.environ.get("MM_ASSETS_DATASETS", str(settings.home() / "datasets.yaml"))
    ).expanduser()


def load_registry() -> dict[str, DatasetSpec]:
    """Built-in entries, then the user's file (when present) adding or replacing entries."""
    text = resources.files("mm_assets.registry").joinpath(BUILTIN_FILE).read_text()
    specs = parse_entries(yaml.safe_load(text), f"built-in {BUILTIN_FILE}")
    user_file = user_registry_file()
    if user_file.is_file():
        specs.update(parse_entries(yaml.safe_load(user_file.read_text()) or {}, str(user_file)))
    return specs
