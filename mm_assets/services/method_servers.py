"""The servers of a benchmark's methods (no speculation, n-gram, the draft): one each.

On CPU, starting a vLLM server is mostly single-threaded Python imports, twice (the API
server, then the engine core it spawns): ~19 s of which generation is a small part on a
demo benchmark (BENCHMARKS.md, "Drafts on the demo benchmark"). Started together, the
start-ups share the cores, and the methods are then sent their requests in turn
(`services/benchmarking.py`), so a drift of the machine falls on all of them. On a GPU
each server would claim most of the device's memory, so there they start one at a time,
each released after its method.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from mm_assets.clients.vllm_server import ManagedVllmServer, ServerStartupError, cuda_available
from mm_assets.services.engine import Serving

logger = logging.getLogger(__name__)


class MethodServers:
    """`with MethodServers(...) as servers: servers.start(methods); url = servers.url(m)`."""

    def __init__(self, serving: Serving, together: bool | None = None) -> None:
        self.serving = serving
        self.together = not cuda_available() if together is None else together
        self.servers: dict[str, ManagedVllmServer] = {}
        self.failed: dict[str, ServerStartupError] = {}
        self.urls: dict[str, str] = {}

    def _server(self, method: str, serve_args: list[str]) -> ManagedVllmServer:
        server = self.servers[method] = self.serving.server(serve_args, label=method)
        return server

    def start(self, methods: Mapping[str, list[str]]) -> None:
        """Declares the methods to run (method -> serve arguments); together, starts them
        all now, in parallel, and waits until each is up or has failed."""
        servers = {m: self._server(m, args) for m, args in methods.items()}
        if not self.together:
            return
        with ThreadPoolExecutor(max_workers=max(len(servers), 1)) as pool:
            futures = {m: pool.submit(s.start) for m, s in servers.items()}
        for method, future in futures.items():
            try:
                self.urls[method] = future.result()
            except ServerStartupError as exc:
                self.failed[method] = exc

    def url(self, method: str) -> str:
        """The method's server, started now when one at a time; raises `ServerStartupError`
        when vLLM did not start it."""
        if method in self.failed:
            raise self.failed[method]
        if method not in self.urls:
            self.urls[method] = self.servers[method].start()
        return self.urls[method]

    def done(self, method: str) -> None:
        """The method is measured: its server is released now."""
        if method in self.servers and method not in self.failed:
            self.servers[method].release()

    def __enter__(self) -> MethodServers:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # the first declared (no speculation: the plain target, which the next dataset's
        # replies serve too) is released last, so a warm one is kept longest
        for server in reversed(self.servers.values()):
            if exc_type is None:
                server.release()
            else:
                server.stop()
