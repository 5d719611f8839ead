"""The managed server is the step's own, without a vLLM server: an impostor on its port
is refused before any request, every route but /health and /metrics asks the start's
key, vLLM's switches that open routes never reach it, and `extra_args` cannot move it."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from mm_assets.assets.resources import VllmResource
from mm_assets.clients import vllm_server
from mm_assets.clients.server_lockdown import (
    MIDDLEWARE,
    SERVER_ENV_WITHHELD,
    KeyOnEveryRoute,
    foreign_listeners,
)
from mm_assets.clients.vllm_server import (
    EngineOptions,
    ManagedVllmServer,
    ServerStartupError,
    free_port,
)

HEALTHY = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class StandIn(ManagedVllmServer):
    """A managed server whose process is a script standing in for vLLM (its port last)."""

    def __init__(self, script: str, log_path: Path) -> None:
        super().__init__("m", [], None, log_path, startup_timeout_s=30)
        self.script = script

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, str(self.port)]

    def environment(self) -> dict[str, str]:
        return dict(os.environ)


@pytest.fixture
def impostor() -> Iterator[tuple[ThreadingHTTPServer, list[str]]]:
    """A local process (this test's) that answers every GET with 200 on a port of its
    own, and the paths it was asked for."""
    paths: list[str] = []

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            paths.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, paths
    server.shutdown()
    server.server_close()


def test_an_impostor_on_the_servers_port_is_refused_before_any_request(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    impostor: tuple[ThreadingHTTPServer, list[str]],
) -> None:
    """It took the port between its draw and vLLM's bind and answers `/health`: the
    start fails naming the port and the process holding it, and stops what it started."""
    port = impostor[0].server_address[1]
    monkeypatch.setattr(vllm_server, "free_port", lambda: port)
    server = StandIn("import time; time.sleep(60)", tmp_path / "vllm.log")
    with pytest.raises(ServerStartupError) as info:
        server.start()
    assert f"port {port} is held by pid {os.getpid()} (" in str(info.value)
    assert server.process is not None and server.process.poll() is not None
    assert impostor[1] == ["/health"]  # its answer was heard; nothing else was sent


def test_a_listener_of_the_process_tree_it_started_is_accepted(tmp_path: Path) -> None:
    server = StandIn(HEALTHY, tmp_path / "vllm.log")
    with server:
        assert server.process is not None and server.port is not None
        assert foreign_listeners(server.port, server.process.pid) == []
        other = subprocess.Popen(["sleep", "30"])
        try:  # the same listener, seen from a tree it is not part of
            (stranger,) = foreign_listeners(server.port, other.pid) or []
        finally:
            other.kill()
            other.wait()
        assert stranger.startswith("pid ") and "http.server" in stranger
    assert foreign_listeners(free_port(), os.getpid()) is None  # nothing listens yet


def _asgi(app: Any, path: str, headers: dict[str, str] | None = None) -> int:
    async def main() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            return (await client.post(path, headers=headers or {})).status_code

    return asyncio.run(main())


async def _served(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def test_every_route_but_health_and_metrics_asks_the_starts_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's own key covers /v1, /v2, /inference and /cohere; `/invocations` (the
    SageMaker router) and /tokenize ran the model for anyone on the machine."""
    monkeypatch.setenv("VLLM_API_KEY", "the-key")
    app = KeyOnEveryRoute(_served)
    for path in ("/invocations", "/tokenize", "/v1/completions", "/metrics/x", "/health/"):
        assert _asgi(app, path) == 401, path
        assert _asgi(app, path, {"Authorization": "Bearer the-ke"}) == 401, path
        assert _asgi(app, path, {"Authorization": "bearer the-key"}) == 200, path
    assert _asgi(app, "/health") == _asgi(app, "/metrics") == 200
    closed: list[dict] = []

    async def socket() -> None:
        async def send(message: dict) -> None:
            closed.append(message)

        scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
        await app(scope, None, send)  # type: ignore[arg-type]

    asyncio.run(socket())
    assert closed == [{"type": "websocket.close", "code": 1008}]
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        KeyOnEveryRoute(_served)


def test_the_managed_server_loads_the_key_on_every_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_server, "cuda_available", lambda: False)
    server = ManagedVllmServer("/models/target", [], None, Path("unused.log"))
    server.port = 8123
    cmd = server.command()
    assert cmd[cmd.index("--middleware") + 1] == MIDDLEWARE
    module, name = MIDDLEWARE.rsplit(".", 1)
    assert name == "KeyOnEveryRoute" and importlib.util.find_spec(module) is not None


def test_vllm_switches_that_open_routes_or_loosen_the_server_never_reach_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The `VLLM_` prefix passes vLLM's settings; the dev mode (/sleep, /collective_rpc),
    runtime LoRA loading, pickle and the like stay with the caller. Each name is one
    vLLM reads, so a rename upstream fails here rather than passing silently."""
    spec = importlib.util.find_spec("vllm")  # found, not imported (that takes ~20 s)
    assert spec is not None and spec.origin is not None
    envs = Path(spec.origin).with_name("envs.py").read_text()
    for name in SERVER_ENV_WITHHELD:
        assert f'"{name}"' in envs, name
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setattr(vllm_server, "cuda_available", lambda: True)
    env = ManagedVllmServer("m", [], None, Path("unused.log")).environment()
    assert {"VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"} <= SERVER_ENV_WITHHELD
    assert not SERVER_ENV_WITHHELD & set(env) and env["VLLM_LOGGING_LEVEL"] == "DEBUG"


@pytest.mark.parametrize(
    "args",
    [
        ["--host", "0.0.0.0"],
        ["--host=0.0.0.0"],
        ["--ho", "0.0.0.0"],  # vLLM's parser takes an unambiguous prefix
        ["--host.x", "1"],
        ["--seed", "0", "--port", "80"],
        ["--po=80"],
        ["--uds", "/tmp/vllm.sock"],
        ["--api-key", "mine"],
        ["--api_key=mine"],  # and `_` for `-`
        ["--allowed-local-media-path", "/"],
        ["--config", "serve.yaml"],
    ],
)
def test_extra_args_cannot_move_the_server_or_widen_what_it_opens(args: list[str]) -> None:
    with pytest.raises(ValidationError, match=r"extra_args may not set --[a-z-]+ \("):
        EngineOptions(extra_args=args)
    with pytest.raises(ValidationError, match="Remove it from the vllm resource's extra_args"):
        VllmResource(extra_args=args)
    tuning = ["--seed", "0", "--api-server-count", "1", "--hf-overrides", "{}", "-O3"]
    assert EngineOptions(extra_args=tuning).extra_args == tuning  # the rest passes
