"""Reaching vLLM for a step: a managed server started here, or external servers.

Managed (the default): one server per step, bound to 127.0.0.1, reading images only
under the dataset's image root, stopped when the step ends (its memory goes with it), or,
with `keep_warm`, left running for a later step of this process that serves the same.
External (`base_urls`): a fleet someone else runs, started with the same extraction
config; the hidden-state files it reports are taken only from `connector_dir`, read
through `server_path_prefix` → `local_path_prefix` when the two machines mount the
storage at different paths.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mm_assets.clients.connector_files import ConnectorDir
from mm_assets.clients.media_urls import ServerAccess
from mm_assets.clients.serve_args import (
    DRAFT_METHODS,
    extraction_args,
    speculative_decoding_args,
)
from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer
from mm_assets.common.urls import shown_url
from mm_assets.domain.model.hidden_states import TextConfigFacts, resolve_dtype, text_config_facts
from mm_assets.storage.layout import weights


@dataclass
class ServerSession:
    """The servers to send a step's requests to, how to reach them (`access`: the API key,
    the directory they open images under); `managed` when started here."""

    base_urls: list[str]
    access: ServerAccess
    managed: ManagedVllmServer | None = None


URLS_ENV = "MM_ASSETS_VLLM_URLS"  # external extraction servers, comma-separated
RESPONSE_URLS_ENV = "MM_ASSETS_VLLM_RESPONSE_URLS"  # external plain servers (target replies)
API_KEY_ENV = "MM_ASSETS_VLLM_API_KEY"
CONNECTOR_DIR_ENV = "MM_ASSETS_VLLM_CONNECTOR_DIR"  # where external servers' files appear
KEEP_WARM_ENV = "MM_ASSETS_VLLM_KEEP_WARM"  # idle managed servers kept for later steps


def keep_warm_from(setting: int | None) -> int:
    """The `keep_warm` setting, or ${KEEP_WARM_ENV} when it is None (else 0)."""
    if setting is not None:
        return setting
    raw = os.environ.get(KEEP_WARM_ENV, "0").strip() or "0"
    if not raw.isdigit():
        raise ValueError(f"${KEEP_WARM_ENV}={raw!r}: give a whole number of servers (0: none)")
    return int(raw)


def env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


@dataclass(frozen=True)
class VllmEngine:
    base_urls: tuple[str, ...] = ()
    options: EngineOptions = field(default_factory=EngineOptions)
    connector: str = "auto"
    startup_timeout_s: float = 600.0
    api_key: str = field(default="EMPTY", repr=False)  # never in a log or an error
    server_path_prefix: str = ""
    local_path_prefix: str = ""
    connector_dir: str = ""
    """External servers: the directory their connector writes into, as seen here."""
    keep_warm: int = 0
    """Managed servers this process keeps idle for a later step (`warm_servers`)."""

    @classmethod
    def from_environment(cls) -> VllmEngine:
        """The extraction engine outside Dagster, as the `vllm` resource's defaults make
        it: the fleet at $MM_ASSETS_VLLM_URLS (managed when unset), its API key."""
        return cls(
            tuple(env_list(URLS_ENV)),
            api_key=os.environ.get(API_KEY_ENV) or "EMPTY",
            connector_dir=os.environ.get(CONNECTOR_DIR_ENV, ""),
        )

    @property
    def managed(self) -> bool:
        return not self.base_urls

    def describe(self) -> str:
        return "managed" if self.managed else ", ".join(map(shown_url, self.base_urls))

    def __repr__(self) -> str:
        """Every field but the key; the fleet's URLs as shown (no password)."""
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}
        shown["base_urls"] = tuple(map(shown_url, self.base_urls))
        return f"VllmEngine({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def for_target(self, facts: TextConfigFacts) -> VllmEngine:
        """This engine with its dtype resolved for a target (`auto`: the config's),
        refusing dtypes the hidden-state store does not know."""
        dtype = resolve_dtype(self.options.dtype, facts)
        return dataclasses.replace(self, options=self.options.model_copy(update={"dtype": dtype}))

    def map_path(self, path: str) -> str:
        """A path the server reported, as this machine sees it."""
        if self.server_path_prefix and path.startswith(self.server_path_prefix):
            return self.local_path_prefix + path[len(self.server_path_prefix) :]
        return path

    def connector_files(self, incoming: Path) -> ConnectorDir:
        """The only directory a step takes hidden-state files from: the managed server's
        `incoming`, or the external servers' `connector_dir` (their paths mapped)."""
        if self.managed:
            return ConnectorDir(incoming)
        if not self.connector_dir:
            raise ValueError(
                "external extraction servers report hidden-state files that this step reads, "
                "moves and deletes, so it takes them only from one directory: set the vllm "
                f"resource's connector_dir (or ${CONNECTOR_DIR_ENV}) to the servers' "
                "shared_storage_path as this machine mounts it"
            )
        return ConnectorDir(Path(self.connector_dir), self.map_path)

    def server(
        self, model: str, serve_args: list[str], image_root: Path | None, log_path: Path
    ) -> ManagedVllmServer:
        """A managed server for `model` with these serve arguments (not started yet)."""
        return ManagedVllmServer(
            model,
            serve_args,
            image_root,
            log_path,
            self.options,
            self.startup_timeout_s,
            keep_warm=self.keep_warm,
        )

    @contextmanager
    def session(
        self, model: str, serve_args: list[str], image_root: Path | None, log_path: Path
    ) -> Iterator[ServerSession]:
        """Servers to send a step's requests to: the external ones, or one started here
        with `serve_args` and stopped when the block ends."""
        if not self.managed:
            yield ServerSession(list(self.base_urls), ServerAccess(self.api_key, image_root))
            return
        server = self.server(model, serve_args, image_root, log_path)
        with server as url:
            yield ServerSession([url], server.access, server)

    def extraction_session(
        self,
        model: str,
        layer_ids: list[int],
        hidden_states_dir: Path,
        image_root: Path | None,
        log_path: Path,
    ) -> AbstractContextManager[ServerSession]:
        """Servers that write hidden states of `layer_ids`, for the duration of a step."""
        args = extraction_args(layer_ids, hidden_states_dir, self.connector) if self.managed else []
        # it writes into this step's own directory: no later step could take it over
        return dataclasses.replace(self, keep_warm=0).session(model, args, image_root, log_path)


@dataclass(frozen=True)
class DraftUnderTest:
    """A trained draft to serve the target with: its checkpoint directory, the hash of its
    weights (what a measurement record is keyed by) and the tokens it proposes a step."""

    dir: Path
    weights_sha256: str
    speculative_tokens: int
    method: str = "eagle3"
    """Its family, as vLLM names the method (`DRAFT_METHODS`)."""

    @classmethod
    def at(cls, directory: Path) -> DraftUnderTest:
        """The checkpoint in `directory` as written (`config.json`, `model.safetensors`);
        refused when its config names a family vLLM is not served with here."""
        from mm_assets.common.hashing import file_sha256
        from mm_assets.domain.model.checkpoint import speculative_tokens

        config = json.loads((directory / "config.json").read_text())
        method = config.get("speculators_model_type")
        if method not in DRAFT_METHODS:
            raise ValueError(
                f"{directory / 'config.json'}: speculators_model_type {method!r} is not one "
                f"of {', '.join(DRAFT_METHODS)}; point at a draft trained here or in "
                "speculators' format"
            )
        weights_sha256 = file_sha256(weights(directory))
        return cls(directory, weights_sha256, speculative_tokens(config), method)

    def serve_args(self) -> list[str]:
        return speculative_decoding_args(self.dir, self.speculative_tokens, self.method)


@dataclass(frozen=True)
class Serving:
    """How a step serves its target, passed whole: the engine (its dtype resolved for
    the target), the target's directory, the one directory vLLM may read images under,
    and the log a managed server writes."""

    engine: VllmEngine
    target_dir: Path
    image_root: Path | None
    log_path: Path

    @classmethod
    def for_target(
        cls, engine: VllmEngine, target_dir: Path, image_root: Path | None, log_path: Path
    ) -> Serving:
        config = json.loads((Path(target_dir) / "config.json").read_text())
        resolved = engine.for_target(text_config_facts(config))
        return cls(resolved, Path(target_dir), image_root, log_path)

    def extraction_session(
        self, layer_ids: list[int], hidden_states_dir: Path
    ) -> AbstractContextManager[ServerSession]:
        """Servers that write the target's hidden states of `layer_ids`, for a step."""
        return self.engine.extraction_session(
            str(self.target_dir), layer_ids, hidden_states_dir, self.image_root, self.log_path
        )

    def server(self, serve_args: list[str], label: str = "") -> ManagedVllmServer:
        """A managed server of the target (not started yet); `label` names its own log
        beside the step's (`vllm_run.<label>.log`)."""
        log = self.log_path
        if label:
            log = log.with_name(f"{log.stem}.{label}{log.suffix}")
        return self.engine.server(str(self.target_dir), serve_args, self.image_root, log)
