"""The Dagster internals the dead-run watch uses (`mm_assets/orchestration/dagster_internals.py`),
each driven against a real instance. A failure here means the installed Dagster changed
them: fix the adapter (one function each), not its callers."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest

from mm_assets.orchestration import dagster_internals as internals
from mm_assets.orchestration import wiring

REPO = Path(__file__).resolve().parents[1]
POOL = "accelerator"


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copyfile(REPO / "dagster.yaml", home / "dagster.yaml")
    with dg.DagsterInstance.local_temp(str(home)) as instance:
        yield instance


def _started_run(instance: dg.DagsterInstance) -> dg.DagsterRun:
    run = dg.DagsterRun("a_job", run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED)
    return instance.add_run(run)


def test_the_adapter_was_checked_on_the_installed_dagster() -> None:
    assert dg.__version__.startswith(internals.CHECKED_ON + "."), (
        f"Dagster {dg.__version__} is installed; the adapter was checked on "
        f"{internals.CHECKED_ON}. Run this file, fix dagster_internals.py where it fails, "
        "then set CHECKED_ON."
    )


def test_the_pool_queue_is_read_and_a_runs_slots_freed(instance: dg.DagsterInstance) -> None:
    assert internals.supports_pools(instance)
    storage = instance.event_log_storage
    storage.set_concurrency_slots(POOL, 1)
    holder, waiting = _started_run(instance), _started_run(instance)
    assert storage.claim_concurrency_slot(POOL, holder.run_id, "hold").is_claimed
    assert not storage.claim_concurrency_slot(POOL, waiting.run_id, "need").is_claimed
    queue = internals.pool_queue(instance, POOL)
    assert queue.holding == ((holder.run_id, "hold"),)
    assert queue.waiting == ((waiting.run_id, "need"),)
    internals.free_slots_of_run(instance, holder.run_id)
    assert holder.run_id not in {run for run, _ in internals.pool_queue(instance, POOL).holding}
    assert storage.claim_concurrency_slot(POOL, waiting.run_id, "need").is_claimed


def test_a_run_is_tagged_and_marked_failed(instance: dg.DagsterInstance) -> None:
    run = _started_run(instance)
    internals.tag_run(instance, run.run_id, {"mm_assets/worker": "first"})
    internals.tag_run(instance, run.run_id, {"mm_assets/worker": "second"})
    assert instance.get_run_by_id(run.run_id).tags["mm_assets/worker"] == "second"
    internals.mark_run_failed(instance, run, "its worker is gone")
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE


@dg.op(pool=POOL)
def _in_the_pool() -> None:
    pass


@dg.job(executor_def=wiring.watch_pools_of(dg.in_process_executor))
def _watched_job() -> None:
    _in_the_pool()


def test_an_executor_sees_its_run_and_the_pools_of_its_plan(
    instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple] = []

    @contextmanager
    def watching(*args: object) -> Iterator[None]:
        seen.append(args)
        yield

    monkeypatch.setattr(wiring, "watching", watching)
    with dg.execute_job(dg.reconstructable(_watched_job), instance=instance) as result:
        assert result.success
        ((run_instance, run, pools, log),) = seen
        assert run_instance is instance and run.run_id == result.run_id
        assert pools == {POOL}
        assert callable(log.info) and callable(log.warning)
    requirements = internals.executor_requirements(dg.multiprocess_executor)({})
    assert requirements, "the multiprocess executor's requirements (a reconstructable job…)"
