"""Dagster resources: where tables live and which target model the pipeline serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from mm_assets import settings
from mm_assets.storage import TableStore


class StorageResource(dg.ConfigurableResource):
    """The embedded store: Parquet tables + a DuckDB catalog under one root directory."""

    root: str = Field(
        default_factory=lambda: str(settings.home()),
        description="Storage root (default $MM_ASSETS_HOME, else ./.mm_assets).",
    )

    def tables(self) -> TableStore:
        return TableStore(Path(self.root))


class TargetModelResource(dg.ConfigurableResource):
    """The model the speculator is trained for: a local directory or a hub id."""

    path: str = Field(
        default_factory=settings.default_target_model,
        description="Model directory or hub id (default $MM_ASSETS_TARGET_MODEL, else the demo).",
    )
    trust_remote_code: bool = Field(
        default=False, description="Run the model repository's own Python code (off by default)."
    )

    def load_processor(self) -> Any:
        """`AutoProcessor` for the target: a ProcessorMixin for VLMs, a tokenizer otherwise."""
        from transformers import AutoProcessor

        local = Path(self.path).expanduser()
        if self.path.startswith(("/", ".", "~")) and not local.exists():
            raise FileNotFoundError(
                f"target model {local} does not exist; build the demo with "
                "`python -m mm_assets.demo build` or set MM_ASSETS_TARGET_MODEL"
            )
        return AutoProcessor.from_pretrained(
            str(local) if local.exists() else self.path, trust_remote_code=self.trust_remote_code
        )
