"""Dagster resources: where tables live and which target model the pipeline serves."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from mm_assets import settings
from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer, extraction_args
from mm_assets.domain.hidden_states import (
    DTYPE_BYTES,
    TextConfigFacts,
    default_layer_ids,
    target_fingerprint,
    text_config_facts,
    validate_layer_ids,
)
from mm_assets.domain.speculator_training import SpeculatorJob
from mm_assets.domain.trainer import TrainSettings
from mm_assets.storage import TableStore
from mm_assets.storage.blobs import BlobStore


class StorageResource(dg.ConfigurableResource):
    """The embedded store: Parquet tables + a DuckDB catalog under one root directory."""

    root: str = Field(
        default_factory=lambda: str(settings.home()),
        description="Storage root (default $MM_ASSETS_HOME, else ./.mm_assets).",
    )

    def tables(self) -> TableStore:
        return TableStore(Path(self.root))

    def blobs(self) -> BlobStore:
        return BlobStore(Path(self.root))


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

    def local_dir(self) -> Path:
        """The model's files on disk (a hub id is resolved through the HF cache)."""
        local = Path(self.path).expanduser()
        if local.is_dir():
            return local
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(self.path))

    def config(self) -> dict:
        return json.loads((self.local_dir() / "config.json").read_text())

    def text_facts(self) -> TextConfigFacts:
        return text_config_facts(self.config())

    def fingerprint(self) -> str:
        return target_fingerprint(self.local_dir())

    def speculator_job(
        self,
        partition: str,
        storage_root: Path,
        settings: TrainSettings,
        layer_ids: list[int] | None = None,
        draft_vocab_size: int = 32000,
        held_out_fraction: float = 0.1,
        speculative_tokens: int = 3,
    ) -> SpeculatorJob:
        """The training job for this target (layer ids default to [2, L//2, L-3, L])."""
        facts = self.text_facts()
        return SpeculatorJob(
            partition=partition,
            storage_root=storage_root,
            target_dir=self.local_dir(),
            target_config=self.config(),
            target_fingerprint=self.fingerprint(),
            layer_ids=validate_layer_ids(
                layer_ids or default_layer_ids(facts.num_layers), facts.num_layers
            ),
            draft_vocab_size=draft_vocab_size,
            held_out_fraction=held_out_fraction,
            speculative_tokens=speculative_tokens,
            settings=settings,
        )


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


@dataclass
class ServerSession:
    base_urls: list[str]
    managed: ManagedVllmServer | None = None


class VllmResource(dg.ConfigurableResource):
    """The vLLM engine that produces hidden states: started per step (managed, default)
    or already running elsewhere (external, when `base_urls` is set)."""

    base_urls: list[str] = Field(
        default_factory=lambda: _env_list("MM_ASSETS_VLLM_URLS"),
        description="External servers (…/v1), started with the extraction config; "
        "empty = start a managed server. Default $MM_ASSETS_VLLM_URLS (comma-separated).",
    )
    dtype: str = Field(default="auto", description="auto = the target config's dtype.")
    max_model_len: int | None = Field(default=None, description="--max-model-len")
    kv_cache_gib: float | None = Field(default=2.0, description="KV cache size in GiB.")
    enforce_eager: bool | None = Field(default=None, description="None: eager on CPU only.")
    extra_args: list[str] = Field(default_factory=list, description="More `vllm` CLI args.")
    connector: str = Field(
        default="auto", description="auto | cpu | stock hidden-states connector."
    )
    startup_timeout_s: float = 600.0
    api_key: str = Field(default_factory=lambda: os.environ.get("MM_ASSETS_VLLM_API_KEY", "EMPTY"))
    server_path_prefix: str = Field(
        default="", description="External mode: prefix of the paths the servers report…"
    )
    local_path_prefix: str = Field(default="", description="…and what it is mounted as here.")

    @property
    def managed(self) -> bool:
        return not self.base_urls

    def resolved_dtype(self, facts: TextConfigFacts) -> str:
        dtype = facts.dtype if self.dtype == "auto" else self.dtype
        if dtype not in DTYPE_BYTES:
            raise ValueError(
                f"dtype {dtype!r} unsupported for hidden states; use {list(DTYPE_BYTES)}"
            )
        return dtype

    def map_path(self, path: str) -> str:
        if self.server_path_prefix and path.startswith(self.server_path_prefix):
            return self.local_path_prefix + path[len(self.server_path_prefix) :]
        return path

    def engine_options(self, dtype: str) -> EngineOptions:
        return EngineOptions(
            dtype=dtype,
            max_model_len=self.max_model_len,
            kv_cache_gib=self.kv_cache_gib,
            enforce_eager=self.enforce_eager,
            extra_args=tuple(self.extra_args),
        )

    @contextmanager
    def session(
        self,
        model: str,
        layer_ids: list[int],
        dtype: str,
        hidden_states_dir: Path,
        image_root: Path | None,
        log_path: Path,
    ) -> Iterator[ServerSession]:
        """Servers to send requests to for the duration of a step."""
        if not self.managed:
            yield ServerSession(list(self.base_urls))
            return
        options = self.engine_options(dtype)
        server = ManagedVllmServer(
            model,
            extraction_args(layer_ids, hidden_states_dir, self.connector),
            image_root,
            log_path,
            options,
            self.startup_timeout_s,
        )
        with server as url:
            yield ServerSession([url], server)
