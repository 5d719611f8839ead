"""Dagster resources: where data lives, which target model the pipeline serves, and how
vLLM is reached. Each is configuration that hands a plain service object to the assets
(`tables()`, `model()`, `engine()`), so the services never see Dagster."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
from pydantic import Field

from mm_assets.assets.config import resource_base
from mm_assets.clients.vllm_server import EngineOptions
from mm_assets.common import paths
from mm_assets.domain.ingest.embedded_images import embedded_images_dir
from mm_assets.services.engine import (
    API_KEY_ENV,
    RESPONSE_URLS_ENV,
    URLS_ENV,
    Serving,
    VllmEngine,
    env_list,
)
from mm_assets.services.target import TargetModel
from mm_assets.storage import ObjectStore, TableStore, open_tables
from mm_assets.storage.blobs import BlobStore
from mm_assets.storage.layout import StorageLayout
from mm_assets.storage.object_store import ENV_VAR as OBJECT_STORE_ENV


class StorageResource(dg.ConfigurableResource):
    """The embedded store: Parquet tables + a DuckDB catalog + blobs under one root; with
    `object_store`, tables and trained checkpoints go to S3/GCS/Azure instead."""

    root: str = Field(
        default_factory=lambda: str(paths.home()),
        description="Storage root (default $MM_ASSETS_HOME, else ./.mm_assets). Hidden-state "
        "blobs, the catalog and logs live here: on a cluster, a filesystem every worker mounts.",
    )
    object_store: str = Field(
        default_factory=lambda: os.environ.get(OBJECT_STORE_ENV, ""),
        description="s3://bucket/prefix (or gs://, az://) for tables and checkpoints; empty = "
        f"under the root. Default ${OBJECT_STORE_ENV}.",
    )

    def tables(self) -> TableStore:
        return open_tables(Path(self.root), self.object_store or None)

    def checkpoint_store(self) -> ObjectStore | None:
        """Where trained checkpoints are published besides the root, if anywhere."""
        return ObjectStore(self.object_store) if self.object_store else None

    def blobs(self, kind: str = "hidden_states") -> BlobStore:
        """Hidden-state files (safetensors) or target responses (JSON)."""
        suffix = ".json" if kind == "responses" else ".safetensors"
        return BlobStore(Path(self.root), kind, suffix)

    def embedded_images_dir(self) -> Path:
        """Where images taken out of dataset rows are written, by content hash."""
        return embedded_images_dir(Path(self.root))

    def log_path(self, name: str) -> Path:
        return StorageLayout(Path(self.root)).log(name)


class TargetModelResource(dg.ConfigurableResource):
    """The model the speculator is trained for: a local directory or a hub id."""

    path: str = Field(
        default_factory=paths.default_target_model,
        description="Model directory or hub id (default $MM_ASSETS_TARGET_MODEL, else the demo).",
    )
    trust_remote_code: bool = Field(
        default=False, description="Run the model repository's own Python code (off by default)."
    )

    def model(self) -> TargetModel:
        return TargetModel(self.path, self.trust_remote_code)


class VllmResource(resource_base("EngineConfig", EngineOptions)):  # type: ignore[misc]
    """The vLLM engine: started per step (managed, default) or already running elsewhere
    (external, when `base_urls` is set). How a managed server runs the target comes from
    `EngineOptions`, declared there once."""

    base_urls: list[str] = Field(
        default_factory=lambda: env_list(URLS_ENV),
        description="External servers (…/v1), started with the extraction config; "
        "empty = start a managed server. Default $MM_ASSETS_VLLM_URLS (comma-separated).",
    )
    response_urls: list[str] = Field(
        default_factory=lambda: env_list(RESPONSE_URLS_ENV),
        description="External servers (…/v1) that generate `target_responses` (plain "
        "serving, no extraction config); empty = start a managed server. Default "
        "$MM_ASSETS_VLLM_RESPONSE_URLS (comma-separated).",
    )
    connector: str = Field(
        default="auto", description="auto | cpu | stock hidden-states connector."
    )
    startup_timeout_s: float = 600.0
    api_key: str = Field(
        default="EMPTY",
        description=f"The servers' API key: set it as dg.EnvVar({API_KEY_ENV!r}) (what "
        f"`definitions` does when ${API_KEY_ENV} is set), never as a value.",
    )
    server_path_prefix: str = Field(
        default="", description="External mode: prefix of the paths the servers report…"
    )
    local_path_prefix: str = Field(default="", description="…and what it is mounted as here.")

    def engine(self, fleet: str = "extraction") -> VllmEngine:
        """The engine of one fleet: `extraction` (hidden states) or `responses`."""
        urls = self.base_urls if fleet == "extraction" else self.response_urls
        options = EngineOptions(
            **{name: getattr(self, name) for name in EngineOptions.model_fields}
        )
        return VllmEngine(
            tuple(urls),
            options,
            self.connector,
            self.startup_timeout_s,
            self.api_key,
            self.server_path_prefix,
            self.local_path_prefix,
        )

    def serving(self, target_dir: Path, image_root: Path | None, log_path: Path) -> Serving:
        """What a step serves the target with (the extraction fleet's engine), whole."""
        return Serving.for_target(self.engine(), target_dir, image_root, log_path)


def vllm_resource() -> VllmResource:
    """The `vllm` resource, its API key read from the environment by Dagster at run time
    (an `EnvVar` shows in the UI as the variable's name, not its value)."""
    if os.environ.get(API_KEY_ENV):
        return VllmResource(api_key=dg.EnvVar(API_KEY_ENV))
    return VllmResource()
