"""Kill a vLLM server at a named crash point (`mm_assets/common/crashpoints.py`): the
thread that is about to rename a stored result into place kills the server, so the kill
lands at a known moment of the run (after so many results) instead of whenever a
watching thread next polls the file system."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from mm_assets.common import files

if TYPE_CHECKING:
    from mm_assets.clients.vllm_server import ManagedVllmServer


def kill_servers_at_store(
    monkeypatch: pytest.MonkeyPatch,
    ready: Callable[[], bool],
    server_pids: Callable[[], Iterable[int]],
) -> list[int]:
    """At the first `before_rename` crash point at which `ready()` holds, SIGKILL the
    process group of every pid `server_pids()` names. Returns the pids killed (filled in
    when it happens)."""
    killed: list[int] = []
    lock = threading.Lock()  # storer threads reach the point concurrently
    reach = files.crash_point

    def point(name: str) -> None:
        reach(name)
        with lock:
            if name != "before_rename" or killed or not ready():
                return
            for pid in server_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                    killed.append(pid)

    monkeypatch.setattr(files, "crash_point", point)
    return killed


def doomed_server(demo_dir: Path, root: Path) -> ManagedVllmServer:
    """A second extraction server for the demo target (as the session's, writing into
    the same connector directory), its log under `root`: the one a test kills."""
    from mm_assets.clients.serve_args import extraction_args
    from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer
    from mm_assets.domain.model.hidden_states import default_layer_ids
    from tests.conftest import SESSION_INCOMING

    return ManagedVllmServer(
        str(demo_dir / "target"),
        extraction_args(default_layer_ids(8), SESSION_INCOMING, "auto"),
        demo_dir / "coco",
        root / "logs" / "doomed.log",
        EngineOptions(dtype="float32", kv_cache_gib=1.0),
        api_key=os.environ["MM_ASSETS_VLLM_API_KEY"],  # the session's fleet key
    )
