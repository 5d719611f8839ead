"""A server's `hidden_states_path` is only a claim: the worker reads, moves or deletes a
file only when it is a regular file directly inside the step's connector directory, under
the name the connector writes. The adversary here is an impostor server."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mm_assets.clients.connector_files import ConnectorDir, OutsideConnectorDir
from mm_assets.domain.model.hidden_states import ExtractionSettings
from mm_assets.domain.model.settings import OnlineSettings
from mm_assets.services.engine import Serving, VllmEngine
from mm_assets.services.extraction import PartitionExtraction
from mm_assets.services.online_batches import OnlineBatches, OnlineStates, TooManyRejections
from mm_assets.services.target import TargetModel
from mm_assets.storage import TableStore, schemas
from mm_assets.storage.blobs import BlobStore

TARGET_CONFIG = {"num_hidden_layers": 8, "hidden_size": 8, "dtype": "float32"}


def _states_file(path: Path, ids: list[int]) -> None:
    """A file the checks would accept for a row with these ids (4 layers, width 8)."""
    hidden = torch.randn(len(ids), 4, 8)
    save_file({"hidden_states": hidden, "token_ids": torch.tensor(ids)}, str(path))


@contextmanager
def _impostor(paths: dict[int, str]) -> Iterator[str]:
    """An HTTP server answering the Completions shape for any prompt, the prompt's ids
    echoed and `hidden_states_path` chosen by its first id."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            model = {"id": "m", "object": "model", "created": 0, "owned_by": "x"}
            self._answer({"object": "list", "data": [model]})

        def do_POST(self) -> None:
            prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
            choice = {"index": 0, "text": "x", "finish_reason": "length",
                      "prompt_token_ids": prompt}  # fmt: skip
            self._answer({
                "id": "c", "object": "text_completion", "created": 0, "model": "m",
                "choices": [choice],
                "kv_transfer_params": {"hidden_states_path": paths[prompt[0]]},
            })  # fmt: skip

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def _snapshot(paths: list[Path]) -> dict[Path, tuple]:
    """What each path is, not followed: kind, link target, content."""
    seen = {}
    for path in paths:
        if path.is_symlink():
            seen[path] = ("link", os.readlink(path), path.resolve().read_bytes())
        elif path.is_dir():
            seen[path] = ("dir", sorted((p.name, p.read_bytes()) for p in path.iterdir()))
        else:
            seen[path] = ("file", path.stat().st_nlink, path.read_bytes())
    return seen


@dataclass
class _Attack:
    """What the impostor answers for each row, and the paths that must stay as they were."""

    connector: Path
    rows: dict[str, list[int]]
    answers: dict[int, str]  # a row's first id -> the path answered for it
    watched: list[Path]

    @classmethod
    def staged(cls, tmp_path: Path) -> _Attack:
        """Every answer names a file the checks would accept, but not one the connector
        wrote in the step's directory: a file outside, a link inside pointing out, a hard
        link to a file outside, `..` out of the directory, a directory inside, one
        outside, a system file (a stand-in: a regressed worker would delete the real one)."""
        connector, outside = tmp_path / "connector", tmp_path / "home" / ".ssh"
        connector.mkdir()
        outside.mkdir(parents=True)
        system = tmp_path / "etc" / "passwd"
        system.parent.mkdir()
        system.write_text("root:x:0:0:root:/root:/bin/bash\n")
        system.chmod(0o444)
        rows = {f"r{i}": [10 * i + 1, 10 * i + 2, 10 * i + 3] for i in range(7)}
        names = ("file", "link", "hard", "dots")
        victims = {name: outside / f"{name}.safetensors" for name in names}
        for victim, ids in zip(victims.values(), rows.values(), strict=False):
            _states_file(victim, ids)
        (connector / "link.safetensors").symlink_to(victims["link"])
        os.link(victims["hard"], connector / "hard.safetensors")
        (connector / "dir.safetensors").mkdir()
        Path(f"{connector}/dir.safetensors.lock").touch()  # what a writer leaves beside it
        _states_file(connector / "dir.safetensors" / "inner.safetensors", rows["r4"])
        Path(f"{outside}.lock").touch()
        answers = [
            victims["file"],
            connector / "link.safetensors",
            connector / "hard.safetensors",
            f"{connector}/../home/.ssh/dots.safetensors",
            connector / "dir.safetensors",
            outside,
            system,
        ]
        watched = [*victims.values(), *(Path(a) for a in answers[1:3]), answers[4], outside]
        watched += [system, Path(f"{outside}.lock"), Path(f"{connector}/dir.safetensors.lock")]
        by_id = {ids[0]: str(a) for ids, a in zip(rows.values(), answers, strict=True)}
        return cls(connector, rows, by_id, watched)

    def tokenized(self) -> list[dict]:
        return [
            {"row_id": row_id, "sample_id": row_id, "source_index": i, "input_ids": ids,
             "loss_mask": [0, 1, 1], "seq_len": 3, "num_supervised": 2, "truncated": False,
             "multimodal": False, "messages": None, "image_hashes": [], "position_ids": None}
            for i, (row_id, ids) in enumerate(self.rows.items())
        ]  # fmt: skip

    def serving(self, url: str, tmp_path: Path) -> Serving:
        """The impostor as an external server, its connector directory named."""
        target = tmp_path / "target"
        target.mkdir(exist_ok=True)
        (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
        engine = VllmEngine((url,), api_key="k", connector_dir=str(self.connector))
        return Serving.for_target(engine, target, None, tmp_path / "vllm.log")


def _stored_files(root: Path) -> list[Path]:
    return [p for p in (root / "blobs").rglob("*") if not p.is_dir()]


def test_an_impostor_answering_paths_outside_the_connector_dir_touches_nothing(
    tmp_path: Path,
) -> None:
    """Offline extraction against the impostor (`_Attack`): each row is rejected with
    the reason; every victim is intact and the blob store holds nothing."""
    attack = _Attack.staged(tmp_path)
    before = _snapshot(attack.watched)
    root = tmp_path / "root"
    tables = TableStore(root)
    tables.write("tokenized_samples", "p", attack.tokenized(), schemas.TOKENIZED)
    with _impostor(attack.answers) as url:
        serving = attack.serving(url, tmp_path)
        target = TargetModel(str(serving.target_dir))
        extraction = PartitionExtraction(
            "p", tables, BlobStore(root), target, serving, ExtractionSettings()
        )
        report = extraction.run()

    assert _snapshot(attack.watched) == before
    assert not _stored_files(root)
    rejected = {r["row_id"]: r["reason"] for r in tables.iter_rows("hidden_states_rejections", "p")}
    assert rejected == dict.fromkeys(attack.rows, "hidden_states_path_outside")
    assert report.requests.stored == 0


@pytest.mark.parametrize("cache", ["keep", "discard"])
def test_online_training_against_the_impostor_touches_nothing(tmp_path: Path, cache) -> None:
    """The same answers while training online: every row of the pass is rejected with
    the reason (the step then fails on `max_rejection_ratio`), nothing is touched and
    nothing stored, in the blob store or its scratch."""
    attack = _Attack.staged(tmp_path)
    before = _snapshot(attack.watched)
    root = tmp_path / "root"
    with _impostor(attack.answers) as url:
        serving = attack.serving(url, tmp_path)
        target = TargetModel(str(serving.target_dir))
        online = OnlineSettings(hidden_states="online", online_cache=cache)
        states = OnlineStates.for_target(
            target, serving, ExtractionSettings(), online, BlobStore(root)
        )
        refs, keys, requests = states.training_rows(attack.tokenized())
        with OnlineBatches(states, keys, requests) as source, pytest.raises(TooManyRejections):
            list(source.batches([refs[:4], refs[4:]], "epoch 1"))

    assert _snapshot(attack.watched) == before
    assert not _stored_files(root)
    (passed,) = source.report.passes
    assert dict(passed.rejected) == {"hidden_states_path_outside": len(attack.rows)}


def test_the_connector_dir_accepts_only_its_own_regular_files(tmp_path: Path) -> None:
    """The rule itself: a `<request id>.safetensors` regular file directly inside the
    directory (as reported, mapped for external servers) opens; anything else raises
    `OutsideConnectorDir`, and `discard` removes only what the rule accepts."""
    connector = ConnectorDir(tmp_path / "in", lambda p: p.replace("/srv/in", str(tmp_path / "in")))
    connector.path.mkdir()
    good = connector.path / "cmpl-9f2c1d0e-0-ab12cd34.safetensors"
    good.write_bytes(b"states")
    Path(f"{good}.lock").touch()
    outside = tmp_path / "victim.safetensors"
    outside.write_bytes(b"keep")
    with connector.open("/srv/in/cmpl-9f2c1d0e-0-ab12cd34.safetensors", 1.0) as file:
        assert file.st.st_size == 6 and file.is_same(good)
        os.rename(good, tmp_path / "moved")  # the name now points out: reads stay with
        good.symlink_to(outside)  # the checked file, and the swap is seen
        assert Path(file.read_path).read_bytes() == b"states" and not file.is_same(good)
    good.unlink()
    (tmp_path / "moved").rename(good)
    (connector.path / "link.safetensors").symlink_to(outside)
    (connector.path / "sub").mkdir()
    (connector.path / "sub" / "x.safetensors").write_bytes(b"keep")
    (connector.path / "dir.safetensors").mkdir()
    os.mkfifo(connector.path / "fifo.safetensors")
    refused = [
        str(outside),
        f"{connector.path}/../victim.safetensors",
        str(connector.path / "sub" / "x.safetensors"),
        str(connector.path / "link.safetensors"),
        str(connector.path / "dir.safetensors"),
        str(connector.path / "fifo.safetensors"),
        str(connector.path / ".hidden.safetensors"),
        str(connector.path / "notes.txt"),
        "relative.safetensors",
    ]
    for reported in refused:
        with pytest.raises(OutsideConnectorDir), connector.open(reported, 1.0):
            pass
        connector.discard(reported)
    assert outside.read_bytes() == b"keep" and (connector.path / "link.safetensors").is_symlink()
    assert (connector.path / "sub" / "x.safetensors").read_bytes() == b"keep"
    assert (connector.path / "dir.safetensors").is_dir()
    connector.discard(str(good))
    assert not good.exists() and not Path(f"{good}.lock").exists()


def test_external_servers_need_their_connector_dir_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A managed server writes into the step's own directory; the files of external
    servers are taken only from `connector_dir` (the resource's, else the environment's),
    and without one the step refuses to start, naming the setting."""
    from mm_assets.assets.resources import VllmResource

    incoming = tmp_path / "incoming"
    assert VllmEngine().connector_files(incoming).path == incoming
    external = VllmEngine(("http://fleet:8000/v1",), connector_dir="/mnt/states")
    assert external.connector_files(incoming).path == Path("/mnt/states")
    monkeypatch.delenv("MM_ASSETS_VLLM_CONNECTOR_DIR", raising=False)
    with pytest.raises(ValueError, match="connector_dir"):
        VllmResource(base_urls=["http://fleet:8000/v1"]).engine().connector_files(incoming)
    monkeypatch.setenv("MM_ASSETS_VLLM_URLS", "http://fleet:8000/v1")
    monkeypatch.setenv("MM_ASSETS_VLLM_CONNECTOR_DIR", "/mnt/env")
    for engine in (VllmEngine.from_environment(), VllmResource().engine()):
        assert engine.connector_files(incoming).path == Path("/mnt/env")
    own = VllmResource(connector_dir="/mnt/own").engine()
    assert own.connector_files(incoming).path == Path("/mnt/own")
