"""Dagster resources: where data lives, which target model the pipeline serves, and how
vLLM is reached. Each is configuration that hands a plain service object to the assets
(`tables()`, `model()`, `engine()`), so the services never see Dagster.

A value left empty comes from the environment when the step runs (the worker's
environment, not the one the code location was loaded in), so a setting changed with
an environment variable needs no reload, and the config a run records holds no secret."""

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
    CONNECTOR_DIR_ENV,
    KEEP_WARM_ENV,
    RESPONSE_URLS_ENV,
    URLS_ENV,
    Serving,
    VllmEngine,
    env_list,
    keep_warm_from,
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
        default="",
        description="Storage root; empty: $MM_ASSETS_HOME when the step runs, else "
        "./.mm_assets. Hidden-state blobs, the catalog and logs live here: on a cluster, a "
        "filesystem every worker mounts.",
    )
    object_store: str = Field(
        default="",
        description="s3://bucket/prefix (or gs://, az://) for tables and checkpoints; empty: "
        f"${OBJECT_STORE_ENV} when the step runs, else under the root.",
    )

    def root_dir(self) -> Path:
        return Path(self.root).expanduser().resolve() if self.root else paths.home()

    def _object_store(self) -> str | None:
        return self.object_store or os.environ.get(OBJECT_STORE_ENV) or None

    def tables(self) -> TableStore:
        return open_tables(self.root_dir(), self._object_store())

    def checkpoint_store(self) -> ObjectStore | None:
        """Where trained checkpoints are published besides the root, if anywhere."""
        url = self._object_store()
        return ObjectStore(url) if url else None

    def blobs(self, kind: str = "hidden_states") -> BlobStore:
        """Hidden-state files (safetensors) or target responses (JSON)."""
        suffix = ".json" if kind == "responses" else ".safetensors"
        return BlobStore(self.root_dir(), kind, suffix)

    def embedded_images_dir(self) -> Path:
        """Where images taken out of dataset rows are written, by content hash."""
        return embedded_images_dir(self.root_dir())

    def log_path(self, name: str) -> Path:
        return StorageLayout(self.root_dir()).log(name)


class TargetModelResource(dg.ConfigurableResource):
    """The model the speculator is trained for: a local directory or a hub id."""

    path: str = Field(
        default="",
        description="Model directory or hub id; empty: $MM_ASSETS_TARGET_MODEL when the step "
        "runs, else the demo's.",
    )
    trust_remote_code: bool = Field(
        default=False, description="Run the model repository's own Python code (off by default)."
    )

    def model(self) -> TargetModel:
        return TargetModel(self.path or paths.default_target_model(), self.trust_remote_code)


class VllmResource(resource_base("EngineConfig", EngineOptions)):  # type: ignore[misc]
    """The vLLM engine: started per step (managed, default) or already running elsewhere
    (external, when `base_urls` is set). How a managed server runs the target comes from
    `EngineOptions`, declared there once."""

    base_urls: list[str] = Field(
        default=[],
        description="External servers (…/v1), started with the extraction config; empty: "
        f"${URLS_ENV} (comma-separated) when the step runs, else a managed server.",
    )
    response_urls: list[str] = Field(
        default=[],
        description="External servers (…/v1) that generate `target_responses` (plain "
        f"serving, no extraction config); empty: ${RESPONSE_URLS_ENV} (comma-separated) "
        "when the step runs, else a managed server.",
    )
    connector: str = Field(
        default="auto", description="auto | cpu | stock hidden-states connector."
    )
    startup_timeout_s: float = Field(
        default=600.0, gt=0, allow_inf_nan=False, description="How long a server may take to start."
    )
    api_key: str = Field(
        default="",
        description=f"The servers' API key; empty: ${API_KEY_ENV} when the step runs. Set "
        "it in the environment (or as a dg.EnvVar), never as a value: run config is stored.",
    )
    server_path_prefix: str = Field(
        default="", description="External mode: prefix of the paths the servers report…"
    )
    local_path_prefix: str = Field(default="", description="…and what it is mounted as here.")
    connector_dir: str = Field(
        default="",
        description="External mode: the servers' shared_storage_path as mounted here, the "
        f"only directory their files are taken from; empty: ${CONNECTOR_DIR_ENV}.",
    )

    keep_warm: int | None = Field(
        default=None,
        ge=0,
        description="Managed servers a run keeps idle for its later steps that serve the "
        "same (0: each step stops its own). Only where the run is the accelerator's only "
        f"user: a kept server holds its memory. None: ${KEEP_WARM_ENV}, else 0.",
    )

    def engine(self, fleet: str = "extraction", target: TargetModel | None = None) -> VllmEngine:
        """The engine of one fleet: `extraction` (hidden states) or `responses`; for a
        target whose repository code runs here (`trust_remote_code`), managed servers
        may run it too."""
        if fleet == "extraction":
            urls = self.base_urls or env_list(URLS_ENV)
        else:
            urls = self.response_urls or env_list(RESPONSE_URLS_ENV)
        options = EngineOptions(
            **{name: getattr(self, name) for name in EngineOptions.model_fields}
        )
        if target is not None and target.trust_remote_code:
            extra = [*options.extra_args, "--trust-remote-code"]
            options = options.model_copy(update={"extra_args": extra})
        return VllmEngine(
            tuple(urls),
            options,
            self.connector,
            self.startup_timeout_s,
            self.api_key or os.environ.get(API_KEY_ENV) or "EMPTY",
            self.server_path_prefix,
            self.local_path_prefix,
            self.connector_dir or os.environ.get(CONNECTOR_DIR_ENV, ""),
            keep_warm=keep_warm_from(self.keep_warm),
        )

    def serving(self, target: TargetModel, image_root: Path | None, log_path: Path) -> Serving:
        """What a step serves the target with (the extraction fleet's engine), whole."""
        engine = self.engine(target=target)
        return Serving.for_target(engine, target.local_dir, image_root, log_path)
