"""Reaching vLLM for a step: a managed server started here, or external servers.

Managed (the default): one server per step, bound to 127.0.0.1, reading images only
under the dataset's image root, stopped when the step ends (its memory goes with it).
External (`base_urls`): a fleet someone else runs, started with the same extraction
config; the hidden-state files it reports are read through `server_path_prefix` →
`local_path_prefix` when the two machines mount the storage at different paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer, extraction_args
from mm_assets.domain.model.hidden_states import TextConfigFacts, resolve_dtype


@dataclass
class ServerSession:
    """The servers to send a step's requests to; `managed` when started here."""

    base_urls: list[str]
    managed: ManagedVllmServer | None = None


@dataclass(frozen=True)
class VllmEngine:
    base_urls: tuple[str, ...] = ()
    options: EngineOptions = field(default_factory=EngineOptions)
    connector: str = "auto"
    startup_timeout_s: float = 600.0
    api_key: str = "EMPTY"
    server_path_prefix: str = ""
    local_path_prefix: str = ""

    @property
    def managed(self) -> bool:
        return not self.base_urls

    def describe(self) -> str:
        return "managed" if self.managed else ", ".join(self.base_urls)

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

    def server(
        self, model: str, serve_args: list[str], image_root: Path | None, log_path: Path
    ) -> ManagedVllmServer:
        """A managed server for `model` with these serve arguments (not started yet)."""
        return ManagedVllmServer(
            model, serve_args, image_root, log_path, self.options, self.startup_timeout_s
        )

    @contextmanager
    def session(
        self, model: str, serve_args: list[str], image_root: Path | None, log_path: Path
    ) -> Iterator[ServerSession]:
        """Servers to send a step's requests to: the external ones, or one started here
        with `serve_args` and stopped when the block ends."""
        if not self.managed:
            yield ServerSession(list(self.base_urls))
            return
        server = self.server(model, serve_args, image_root, log_path)
        with server as url:
            yield ServerSession([url], server)

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
        return self.session(model, args, image_root, log_path)
