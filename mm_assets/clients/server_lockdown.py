"""What keeps a managed vLLM server the step's own: no other local process answers in
its place, drives it around its key, or moves it off loopback.

- The port is drawn free and bound by vLLM later (with SO_REUSEADDR, listening only once
  the engine is up): any local process can listen on it meanwhile. The step trusts the
  port once every listener on it is of the tree it started (`foreign_listeners`).
- vLLM's `--api-key` guards only /v1, /v2, /inference and /cohere (`GUARDED_PREFIX`); the
  SageMaker `/invocations`, /tokenize, /detokenize and /pooling run unguarded, with no
  switch to turn them off. `KeyOnEveryRoute`, loaded by vLLM's `--middleware`, asks the
  start's key on every route but /health and /metrics.
- `extra_args` go last on vLLM's command line, where a repeated flag wins and argparse
  takes any unambiguous prefix and `_` for `-`: `refuse_reserved_flags` refuses there
  the flags the server's confinement rests on.

Imported inside the vLLM server (`--middleware`): the standard library, psutil and
`mm_assets.common` only.
"""

from __future__ import annotations

import contextlib
import hmac
import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

import psutil

from mm_assets.common.urls import url_password

MIDDLEWARE = f"{__name__}.KeyOnEveryRoute"
OPEN_PATHS = frozenset({"/health", "/metrics"})  # the start-up probe; counters, no model run
RESERVED_FLAGS = {
    "--host": "the server listens on 127.0.0.1 only",
    "--port": "the port is drawn free at each start and checked to be the server's",
    "--uds": "the server listens on the loopback port the step checks",
    "--api-key": "each start draws its own key, given in the server's environment",
    "--allowed-local-media-path": "the server opens images under one narrow directory",
    "--config": "a config file could set any of the flags above",
}

# Variables `server_environment` lets through by prefix but withholds: the key, and vLLM
# switches that would open routes or loosen the server (tests check them against envs.py).
SERVER_ENV_WITHHELD = frozenset(
    {
        "VLLM_API_KEY",  # each start draws its own
        "VLLM_SERVER_DEV_MODE",  # /sleep, /collective_rpc, cache resets, the RL routes
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",  # /v1/load_lora_adapter: any path's adapter
        "VLLM_LORA_RESOLVER_CACHE_DIR",  # adapters resolved by name at request time
        "VLLM_LORA_RESOLVER_HF_REPO_LIST",
        "VLLM_ALLOW_INSECURE_SERIALIZATION",  # pickle between its processes
        "VLLM_DEBUG_LOG_API_SERVER_RESPONSE",  # answers into the log
        "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH",  # a dead engine behind a live API
    }
)


def refuse_reserved_flags(args: Sequence[str]) -> list[str]:
    """`args` when none sets a flag the server's confinement rests on, in any form vLLM's
    parser accepts (`--host=…`, `--api_key`, a prefix such as `--ho`, `--host.x`)."""
    for arg in args:
        name = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if not name.startswith("--") or len(name) < 3:
            continue
        for flag, why in RESERVED_FLAGS.items():
            if flag.startswith(name):
                raise ValueError(
                    f"extra_args may not set {flag} ({arg!r}): {why}. Remove it from the "
                    "vllm resource's extra_args; to serve elsewhere, run the servers "
                    "yourself and give their URLs (MM_ASSETS_VLLM_URLS)."
                )
    return list(args)


def describe_process(pid: int | None) -> str:
    if pid is None:
        return "a process this user cannot see"
    with contextlib.suppress(psutil.Error):
        return f"pid {pid} ({' '.join(psutil.Process(pid).cmdline())[:200]})"
    return f"pid {pid}"


def foreign_listeners(port: int, root_pid: int) -> list[str] | None:
    """The processes other than `root_pid` and its descendants that listen on TCP `port`,
    described; None while no process listens on it."""
    try:
        root = psutil.Process(root_pid)
        ours = {root_pid, *(child.pid for child in root.children(recursive=True))}
    except psutil.NoSuchProcess:
        ours = set()
    holders = {
        conn.pid
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
    }
    if not holders:
        return None
    return [describe_process(pid) for pid in sorted(holders - ours, key=lambda p: p or 0)]


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class KeyOnEveryRoute:
    """ASGI middleware: a request without `Bearer $VLLM_API_KEY` is refused on every path
    but `OPEN_PATHS`; without a key it raises, so an unguarded server never starts."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError(f"{MIDDLEWARE} needs the start's key in VLLM_API_KEY")
        self.app, self.key = app, key.encode()

    def authorized(self, scope: Scope) -> bool:
        if scope["path"].removeprefix(scope.get("root_path", "")) in OPEN_PATHS:
            return True
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.authorized(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": b'{"error": "Unauthorized"}'})


# What a managed server inherits of the caller's environment: what Python, vLLM, torch,
# the CPU/GPU runtimes and the (offline) hub client read, and the run marker the dead-run
# watch finds a run's processes by. Credentials, API keys and tokens stay with the caller.
_NAMES = """PATH HOME USER LOGNAME SHELL LANG LANGUAGE TZ TERM TMPDIR PYTHONPATH PYTHONHOME
VIRTUAL_ENV LD_LIBRARY_PATH LD_PRELOAD XDG_CACHE_HOME XDG_CONFIG_HOME XDG_RUNTIME_DIR CC CXX
HF_HOME HF_HUB_CACHE HF_HUB_OFFLINE TRANSFORMERS_OFFLINE MM_ASSETS_RUN_ID"""
_PREFIXES = (
    "VLLM_ LC_ CUDA_ NVIDIA_ NCCL_ OMP_ KMP_ MKL_ GOMP_ TORCH PYTORCH_ TRITON_ MM_ASSETS_CRASH_"
)
SERVER_ENV_NAMES, SERVER_ENV_PREFIXES = frozenset(_NAMES.split()), tuple(_PREFIXES.split())


def server_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The allowed variables of `env`, less any whose value is a URL with a password."""
    return {
        name: value
        for name, value in env.items()
        if (name in SERVER_ENV_NAMES or name.startswith(SERVER_ENV_PREFIXES))
        and name not in SERVER_ENV_WITHHELD
        and not url_password(value)
    }
