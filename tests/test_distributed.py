"""Steps on more than one worker: the text demo chain through Dagster's Celery executor,
with a real Redis broker and two Celery workers, each a separate process with its own
working directory, sharing only the storage root (blobs, catalog, Dagster instance) and
an S3 object store (SeaweedFS) that holds the tables and the published checkpoint. The
CPU worker listens on the `dagster` queue, the "GPU" worker on `accelerator`; every step
must run in the worker its queue names, and the outputs must equal the local executor's."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.chaos import REPO, Chain, _env, check, start
from mm_assets.clients.vllm_server import free_port

BIN = Path(sys.executable).parent
PREP_STEPS = {
    "raw_dataset", "coco_image_availability", "normalized_conversations", "tokenized_samples",
}  # fmt: skip
ACCELERATOR_STEPS = {"target_responses", "hidden_states", "trained_speculator"}


@contextlib.contextmanager
def _process(command: list[str], log: Path, cwd: Path, env: dict[str, str]) -> Iterator[Path]:
    """`command` in its own session, its output in `log`; its group ends with the block."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        yield log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for(log: Path, text: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        time.sleep(0.3)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
    raise AssertionError(f"{text!r} not in {log} after {timeout_s:.0f}s:\n{tail}")


@contextlib.contextmanager
def _redis(directory: Path) -> Iterator[str]:
    redis = shutil.which("redis-server")
    assert redis, "redis-server is missing: `make setup` installs it (Debian's redis-server)"
    port = free_port()
    command = [redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
               "no", "--dir", str(directory)]  # fmt: skip
    with _process(command, directory / "redis.log", directory, dict(os.environ)) as log:
        _wait_for(log, "Ready to accept connections")
        yield f"redis://127.0.0.1:{port}/0"


def _step_workers(dagster_home: Path) -> dict[str, set[str]]:
    """Each step of the run: the Celery workers that executed it (the engine event each
    task reports)."""
    import dagster as dg

    instance = dg.DagsterInstance.from_config(str(dagster_home))
    (run,) = instance.get_runs()
    workers: dict[str, set[str]] = {}
    for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        event = entry.dagster_event
        assert event is not None
        metadata = event.engine_event_data.metadata
        if "Celery worker" in metadata:
            worker = str(metadata["Celery worker"].value).split("@")[0]
            workers.setdefault(event.step_key or "", set()).add(worker)
    return workers


@pytest.mark.slow
@pytest.mark.long
def test_the_text_chain_on_two_celery_workers_equals_the_local_run(
    clean_text_chain: tuple[Chain, Path, object],
    demo_dir: Path,
    tmp_path: Path,
    object_store_url: str,
) -> None:
    chain, clean, _ = clean_text_chain
    root = tmp_path / "shared"
    root.mkdir()
    with _redis(tmp_path) as broker:
        extra = {
            "MM_ASSETS_EXECUTOR": "celery",
            "MM_ASSETS_CELERY_BROKER": broker,
            "MM_ASSETS_OBJECT_STORE": object_store_url,  # the S3 client settings: os.environ
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        }
        env = _env(root, demo_dir, chain, extra)
        config = REPO / "deploy" / "celery.yaml"  # the committed one: broker from the env
        with contextlib.ExitStack() as workers:
            for name, queue in (("cpu", "dagster"), ("gpu", "accelerator")):
                cwd = tmp_path / f"worker_{name}"
                cwd.mkdir()
                command = [
                    str(BIN / "dagster-celery"), "worker", "start", "-A", "dagster_celery.app",
                    "-y", str(config), "-n", name, "-q", queue, "--", "--pool=solo",
                ]  # fmt: skip
                log = workers.enter_context(_process(command, cwd / "worker.log", cwd, env))
                _wait_for(log, f"{name}@")
                _wait_for(log, "ready.")
            run = start(root, demo_dir, chain, extra)
            assert run.wait(timeout=900) == 0, (root / "run.log").read_text()[-4000:]

    ran = _step_workers(root / "dagster_home")
    assert set(ran) == PREP_STEPS | ACCELERATOR_STEPS
    assert all(ran[step] == {"cpu"} for step in PREP_STEPS), ran
    assert all(ran[step] == {"gpu"} for step in ACCELERATOR_STEPS), ran
    assert check(root, clean, chain.partition, object_store_url) == []
    assert not (root / "tables").exists()  # every table went to the object store
    _assert_published(object_store_url, root / "speculators" / chain.partition, chain.partition)


def _assert_published(object_store_url: str, checkpoint: Path, partition: str) -> None:
    """The object store holds the worker's checkpoint, byte for byte."""
    from mm_assets.storage import ObjectStore

    store = ObjectStore(object_store_url)
    remote = store.key("speculators", partition)
    names = {Path(key).name for key in store.fs.ls(remote, detail=False)}
    local = {p.name for p in checkpoint.iterdir() if p.is_file()}
    assert names == local | {"mm_assets_published.json"}
    for name in local:
        assert store.fs.cat_file(f"{remote}/{name}") == (checkpoint / name).read_bytes(), name


@pytest.mark.parametrize("choice", ["in_process", "multiprocess", "celery", "k8s"])
def test_the_executor_is_chosen_by_the_environment(
    choice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mm_assets.assets.executors import step_executor
    from mm_assets.orchestration.wiring import is_watched

    monkeypatch.setenv("MM_ASSETS_EXECUTOR", choice)
    monkeypatch.setenv("MM_ASSETS_CELERY_BROKER", "redis://broker.example:6379/1")
    executor = step_executor()
    assert executor.name == choice and is_watched(executor)


def test_an_unknown_executor_is_refused_with_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    from mm_assets.assets.executors import step_executor

    monkeypatch.setenv("MM_ASSETS_EXECUTOR", "ray")
    with pytest.raises(ValueError, match="in_process, multiprocess, celery, k8s"):
        step_executor()


@pytest.mark.parametrize(("gpus", "limit"), [("1", "1"), ("2", "2"), ("0", None)])
def test_accelerator_steps_name_their_queue_and_gpus(
    gpus: str, limit: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mm_assets.assets.executors import accelerator_step_tags

    monkeypatch.setenv("MM_ASSETS_ACCELERATOR_GPUS", gpus)
    tags = accelerator_step_tags()
    assert tags["dagster-celery/queue"] == "accelerator"
    if limit is None:
        assert "dagster-k8s/config" not in tags
    else:
        resources = tags["dagster-k8s/config"]["container_config"]["resources"]
        assert resources == {"limits": {"nvidia.com/gpu": limit}}


def test_dagster_k8s_reads_the_gpu_request_of_an_accelerator_step() -> None:
    """What the k8s executor makes of the step's tags (its own parser)."""
    from dagster_k8s.job import get_user_defined_k8s_config

    from mm_assets.definitions import defs

    for asset in ("target_responses", "hidden_states", "trained_speculator"):
        config = get_user_defined_k8s_config(defs.get_assets_def(asset).op.tags)
        assert config.container_config["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    cpu_step = get_user_defined_k8s_config(defs.get_assets_def("tokenized_samples").op.tags)
    assert not cpu_step.container_config
