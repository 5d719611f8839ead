"""Where mm_assets keeps its data, from the environment.

One root (`MM_ASSETS_HOME`, default `./.mm_assets`) holds tables, blobs, speculators and,
unless `DAGSTER_HOME` is set, Dagster's instance, so a run's history survives the process.
"""

from __future__ import annotations

import os
import uuid
from importlib import resources
from pathlib import Path


def home() -> Path:
    """The storage root; created on first use."""
    root = Path(os.environ.get("MM_ASSETS_HOME", ".mm_assets")).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def demo_dir() -> Path:
    """Where `mm_assets.demo` builds the demo model, images and datasets."""
    return home() / "demo"


def demo_cache() -> Path | None:
    """Where trained demo targets are kept across homes (`MM_ASSETS_DEMO_CACHE`), keyed
    by the code and settings that built them; None: each home trains its own."""
    cache = os.environ.get("MM_ASSETS_DEMO_CACHE")
    if not cache:
        return None
    path = Path(cache).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_target_model() -> str:
    """The target model when `MM_ASSETS_TARGET_MODEL` is unset: the locally built demo."""
    return os.environ.get("MM_ASSETS_TARGET_MODEL", str(demo_dir() / "target"))


def ensure_dagster_home() -> Path:
    """Point `DAGSTER_HOME` under the storage root when unset, so run history persists,
    and give it the project's `dagster.yaml` (pool limits, run monitoring) when it has
    none; an existing one is the user's. Every entry point calls this first."""
    path = Path(os.environ.get("DAGSTER_HOME") or home() / "dagster_home")
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DAGSTER_HOME", str(path))
    config = path / "dagster.yaml"
    if not config.exists():
        # Beside it, then renamed: a process creating its instance meanwhile reads all or none.
        staged = path / f".dagster.yaml.{uuid.uuid4().hex}"
        staged.write_text(instance_config())
        os.replace(staged, config)
    return path


def instance_config() -> str:
    """The project's Dagster instance config (`dagster.yaml`, shipped in the package)."""
    return resources.files("mm_assets").joinpath("dagster.yaml").read_text()
