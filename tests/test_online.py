"""Online hidden states (`hidden_states: online`): `trained_speculator` fetches each
batch's states from a real CPU vLLM server while it trains. Each test works in a home of
its own made from the session's prep tables, so nothing is stored there at the start;
the session's offline run of the same partition (`demo_hidden_states`) is the reference."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import torch
from safetensors.torch import load_file

from mm_assets.assets.resources import StorageResource, VllmResource
from mm_assets.domain.model import trainer
from mm_assets.domain.model.draft_set import SourceRows, draft_set
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.domain.model.trainer import Ranks, batch_plan_sha256
from mm_assets.domain.model.training_data import pack
from mm_assets.services.draft_sources import sample_refs, stored_layer_ids
from mm_assets.storage import schemas
from tests.conftest import PREP_ASSETS, SESSION_HOME, materialize
from tests.server_kills import doomed_server

pytestmark = pytest.mark.slow
PARTITION = "demo_sharegpt4v_coco"
TRAINING = {"epochs": 2, "batch_tokens": 512, "measure_in_vllm": False}
ONLINE = {"hidden_states": "online"}
REPO = Path(__file__).resolve().parents[1]


def _home(root: Path, partitions: tuple[str, ...] = (PARTITION,)) -> Path:
    """A storage root holding the partitions' prep tables and nothing else."""
    for table in (*PREP_ASSETS, "token_frequencies"):
        for partition in partitions:
            name = Path("tables") / table / f"dataset={partition}" / "data.parquet"
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(SESSION_HOME / name, root / name)
    return root


def _run(
    root: Path,
    urls: list[str],
    config: dict,
    assets: tuple[str, ...] = ("hidden_states", "trained_speculator"),
    extraction: dict | None = None,
    raise_on_error: bool = True,
) -> dg.ExecuteInProcessResult:
    ops = {"trained_speculator": {"config": {**TRAINING, **config}}}
    if extraction:
        ops["hidden_states"] = {"config": extraction}
    resources = {"storage": StorageResource(root=str(root)), "vllm": VllmResource(base_urls=urls)}
    return materialize(PARTITION, list(assets), resources, raise_on_error, {"ops": ops})


def _meta(result: dg.ExecuteInProcessResult, asset: str) -> dict:
    (mat,) = result.asset_materializations_for_node(asset)
    return {k: v.value for k, v in mat.metadata.items()}


def _offline_plan() -> str:
    """The batches offline training takes on the session's stored states."""
    tables = StorageResource().tables()
    refs = sample_refs(tables, PARTITION, stored_layer_ids(tables, PARTITION))
    settings = SpeculatorSettings(epochs=TRAINING["epochs"], batch_tokens=TRAINING["batch_tokens"])
    rows = draft_set([SourceRows(PARTITION, refs, {})], settings.held_out_fraction, settings.seed)
    return batch_plan_sha256(pack(rows.train, settings.batch_tokens), settings, Ranks())


def _failure(result: dg.ExecuteInProcessResult) -> str:
    """The failed step's error and its causes."""
    (event,) = result.get_step_failure_events()
    error, messages = event.step_failure_data.error, []
    while error is not None:
        messages.append(error.message)
        error = error.cause
    return "\n".join(messages)


def _kill_after_first_epoch(monkeypatch: pytest.MonkeyPatch, doomed) -> list[int]:
    """SIGKILL `doomed`'s process group once the trainer has saved epoch 1; the pids
    killed (filled in when it happens)."""
    killed: list[int] = []
    reach = trainer.crash_point

    def point(name: str) -> None:
        reach(name)
        if name == "after_epoch" and not killed and doomed.process is not None:
            os.killpg(os.getpgid(doomed.process.pid), signal.SIGKILL)
            killed.append(doomed.process.pid)

    monkeypatch.setattr(trainer, "crash_point", point)
    return killed


def _rows_fetched(trained: dict) -> int:
    """With `discard`, every pass fetches its rows: each epoch's training rows, and the
    held-out rows for the untrained draft's replay and after every epoch."""
    epochs = TRAINING["epochs"]
    return epochs * trained["train_rows"] + (epochs + 1) * trained["held_out_rows"]


def _blobs(root: Path) -> dict[str, Path]:
    return {p.stem: p for p in (root / "blobs").rglob("*.safetensors")}


def test_keep_trains_on_the_offline_batches_and_an_offline_rerun_requests_nothing(
    demo_hidden_states, vllm_server, tmp_path: Path
) -> None:
    """`keep`: hidden_states stores nothing, training fetches every row once (later
    epochs and the evaluation read them back), the blobs are those offline extraction
    stores (same keys; values within the engine's batch-composition tolerance), the
    batches are offline's; then an offline run of the same home sends no request and
    trains to the same loss."""
    root = _home(tmp_path / "keep")
    result = _run(root, [vllm_server.base_url], ONLINE)
    assert _meta(result, "hidden_states")["hidden_states_source"] == "online"
    assert not (root / "tables" / "hidden_states_manifest").exists()
    trained = _meta(result, "trained_speculator")
    assert trained["hidden_states_source"] == "online (keep)"
    assert trained["batch_plan_sha256"] == _offline_plan()

    reference = {
        r["blob_key"]: SESSION_HOME / r["path"]
        for r in StorageResource().tables().iter_rows("hidden_states_manifest", PARTITION)
    }
    stored = _blobs(root)
    assert set(stored) == set(reference)
    assert trained["online_rows_fetched"] == trained["online_requests_sent"] == len(reference)
    for key, path in stored.items():
        a, b = load_file(path), load_file(reference[key])
        assert torch.equal(a["token_ids"], b["token_ids"])
        # the same rows in other batches: vLLM's CPU kernels differ by ~1e-6 relative
        scale = b["hidden_states"].abs().amax(-1, keepdim=True)
        assert ((a["hidden_states"] - b["hidden_states"]).abs() / scale).max() <= 1e-3

    again = _run(root, [vllm_server.base_url], {"hidden_states": "stored"})
    states = _meta(again, "hidden_states")
    assert states["requests_sent"] == 0 and states["cache_hits"] == len(reference)
    offline = _meta(again, "trained_speculator")
    assert offline["hidden_states_source"] == "stored"
    assert offline["batch_plan_sha256"] == trained["batch_plan_sha256"]
    assert offline["final_train_loss"] == pytest.approx(trained["final_train_loss"], rel=1e-5)


def test_a_draft_of_several_datasets_trains_online_on_the_offline_batches(
    demo_hidden_states, vllm_server, tmp_path: Path
) -> None:
    """`demo_mix` (both demo datasets) with `hidden_states: online` in a home with only
    their prep tables: each source's rows are fetched the same way (what is stored is
    exactly offline extraction's blobs of the rows it trains and holds out), and the
    batches are those offline training takes on the session's stored states."""
    from mm_assets.services.draft_sources import row_keys

    sources = ("demo_sharegpt4v_coco", "demo_sharegpt")
    root = _home(tmp_path / "mix", sources)
    config = {**TRAINING, **ONLINE}
    resources = {
        "storage": StorageResource(root=str(root)),
        "vllm": VllmResource(base_urls=[vllm_server.base_url]),
    }
    result = materialize(
        "demo_mix", ["trained_draft"], resources, True,
        {"ops": {"trained_draft": {"config": config}}},
    )  # fmt: skip
    trained = _meta(result, "trained_draft")
    assert trained["hidden_states_source"] == "online (keep)"
    tables = StorageResource().tables()
    offline = [
        SourceRows(s, sample_refs(tables, s, stored_layer_ids(tables, s)), row_keys(tables, s))
        for s in sources
    ]
    settings = SpeculatorSettings(epochs=TRAINING["epochs"], batch_tokens=TRAINING["batch_tokens"])
    rows = draft_set(offline, settings.held_out_fraction, settings.seed)
    plan = batch_plan_sha256(pack(rows.train, settings.batch_tokens), settings, Ranks())
    assert trained["batch_plan_sha256"] == plan
    manifests = {
        f"{s}:{r['row_id']}": r["blob_key"]
        for s in sources
        for r in tables.iter_rows("hidden_states_manifest", s)
    }
    used = {manifests[ref.row_id] for ref in (*rows.train, *rows.held_out)}
    assert set(_blobs(root)) == used
    assert all(trained[f"rows_{s}"] > 0 for s in sources)


def test_a_row_vllm_tokenizes_differently_is_rejected_in_each_pass_and_counted(
    demo_hidden_states, vllm_server, demo_dir: Path, tmp_path: Path
) -> None:
    """One multimodal row stored one image placeholder short: vLLM's ids differ, so
    every pass that holds it rejects it as `token_mismatch` (two: its two epochs, or the
    evaluation before and after training) and trains without it; nothing is stored for
    it. With `max_rejection_ratio: 0` the same run fails and says why."""
    root = _home(tmp_path / "mismatch")
    tables = StorageResource(root=str(root)).tables()
    rows = list(tables.iter_rows("tokenized_samples", PARTITION))
    victim = next(r for r in rows if r["multimodal"])
    from mm_assets.services.target import TargetModel

    image_token = TargetModel(str(demo_dir / "target")).facts.image_token_id
    ids = list(victim["input_ids"])
    del ids[ids.index(image_token)]
    victim.update(input_ids=ids, loss_mask=victim["loss_mask"][1:], seq_len=len(ids))
    tables.write("tokenized_samples", PARTITION, rows, schemas.TOKENIZED)

    trained = _meta(_run(root, [vllm_server.base_url], ONLINE), "trained_speculator")
    assert trained["online_rejected_token_mismatch"] == 2
    assert len(_blobs(root)) == len(rows) - 1

    failed = _run(
        root, [vllm_server.base_url], {**ONLINE, "retrain": True},
        extraction={"max_rejection_ratio": 0.0}, raise_on_error=False,
    )  # fmt: skip
    assert not failed.success
    message = _failure(failed)
    assert f"1/{len(rows)} rows rejected" in message and "token_mismatch" in message


@pytest.mark.long
def test_discard_through_the_cli_starts_its_server_and_leaves_no_blob(
    demo_hidden_states, tmp_path: Path
) -> None:
    """`discard` through `dagster asset materialize` with a managed server (started by
    the training step): every pass requests its rows again, the batches are offline's,
    the scratch directory never held more than prefetch_batches + 1 batches, and no
    hidden state is left on disk."""
    root = _home(tmp_path / "home")
    (tmp_path / "dagster_home").mkdir()
    env = {
        **os.environ,
        "MM_ASSETS_HOME": str(root),
        "DAGSTER_HOME": str(tmp_path / "dagster_home"),
        "MM_ASSETS_TARGET_MODEL": str(SESSION_HOME / "demo" / "target"),
    }
    env.pop("MM_ASSETS_VLLM_URLS", None)
    config = {**TRAINING, **ONLINE, "online_cache": "discard", "prefetch_batches": 1}
    run_config = {"ops": {"trained_speculator": {"config": config}}}
    from tests.test_cli import _latest_metadata

    proc = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "asset", "materialize", "-m",
         "mm_assets.definitions", "--select", "hidden_states,trained_speculator",
         "--partition", PARTITION, "--config-json", json.dumps(run_config)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = _latest_metadata(env, "trained_speculator")
    assert isinstance(trained["online_server_startup_s"], float)
    passes = _rows_fetched(trained)
    assert trained["online_rows_fetched"] == passes and trained["online_cache_hits"] == 0
    assert trained["batch_plan_sha256"] == _offline_plan()
    peak, largest = trained["online_disk_peak_bytes"], trained["online_largest_batch_bytes"]
    assert 0 < largest <= peak <= 2 * largest
    assert not _blobs(root)


@pytest.mark.long
def test_a_server_killed_mid_training_fails_the_step_and_the_rerun_resumes(
    demo_hidden_states, vllm_server, demo_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """The only server dies after epoch 1 (SIGKILL, its process group): epoch 2's
    requests fail, and the step stops with a message saying so. Rerun against a live
    server: it resumes from epoch 1's state, fetches what it still needs, and the
    checkpoint serves in vLLM with speculative decoding."""
    root = _home(tmp_path / "home")
    doomed = doomed_server(demo_dir, root)
    killed = _kill_after_first_epoch(monkeypatch, doomed)
    discard = {**ONLINE, "online_cache": "discard"}
    quick_failure = {"max_retries": 1, "breaker_failures": 2}
    with doomed:
        failed = _run(
            root, [doomed.base_url], discard, extraction=quick_failure, raise_on_error=False
        )
    assert killed and not failed.success
    assert "vLLM stopped answering during online training (epoch 2)" in _failure(failed)

    measured = {**discard, "measure_in_vllm": True, "vllm_prompts": 4,
                "measure_untrained_in_vllm": False}  # fmt: skip
    again = _run(root, [vllm_server.base_url], measured, ("trained_speculator",))
    trained = _meta(again, "trained_speculator")
    assert trained["resumed_from_epoch"] == 1
    assert (
        "| epoch 1 |" not in trained["online_passes"] and "| epoch 2 |" in trained["online_passes"]
    )
    assert trained["vllm_prompts"] == 4 and trained["vllm_acceptance_length"] >= 1.0


@pytest.mark.long
def test_on_a_fleet_training_goes_on_when_a_server_dies(
    demo_hidden_states, vllm_server, demo_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """Two servers; one dies after epoch 1 (SIGKILL, its process group). Its requests go
    to the other, it leaves the rotation, and the step trains to the end with every row
    of every pass (discard: each epoch asks again)."""
    root = _home(tmp_path / "home")
    doomed = doomed_server(demo_dir, root)
    killed = _kill_after_first_epoch(monkeypatch, doomed)
    with doomed:
        fleet = [doomed.base_url, vllm_server.base_url]
        result = _run(root, fleet, {**ONLINE, "online_cache": "discard"})
    trained = _meta(result, "trained_speculator")
    assert killed and trained.get("online_rejected_request_refused") is None
    passes = _rows_fetched(trained)
    assert trained["online_rows_fetched"] == passes
    rows = {line.split("|")[1].strip(): line for line in trained["online_servers"].splitlines()}
    assert "| 1 | no |" in rows[doomed.base_url]  # taken out once, out of rotation
    assert trained["batch_plan_sha256"] == _offline_plan()
