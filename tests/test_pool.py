"""Dead runs release what they hold (`mm_assets/orchestration/`).

A run killed with SIGKILL while its step holds the accelerator pool's slot stays STARTED and
keeps the slot; the next run's accelerator step must still start, unless a server the dead
run started still runs. The end-to-end tests (slow) run tiny assets made with the product's
own `accelerator_asset` decorator and executor (the `defs` below, loaded by `dagster asset
materialize -m tests.test_pool`), in a Dagster home with the repo's dagster.yaml (pool limit
1), so nothing waits on vLLM. The others judge holders in a temporary instance, and check
that the product's assets and executor carry the watch."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dagster as dg
import psutil
import pytest

from mm_assets.assets.executors import step_executor
from mm_assets.assets.partitions import (
    ACCELERATOR_POOL,
    ACCELERATOR_WATCH,
    REGISTRY,
    accelerator_asset,
)
from mm_assets.orchestration import cli, dead_runs, processes, wiring
from mm_assets.orchestration.processes import RUN_ENV, Machine, ProcessId, RunMark

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PARTITION = sorted(REGISTRY)[0]


@accelerator_asset("1", deps=[], kinds={"python"})
def holds_the_accelerator(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    """Holds the accelerator's slot until its run is killed."""
    time.sleep(600)
    return dg.MaterializeResult()


@accelerator_asset("1", deps=[], kinds={"python"})
def serves_on_the_accelerator(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    """Holds the slot, with a "server" in its own session, as the managed vLLM server."""
    subprocess.Popen(["sleep", "600"], start_new_session=True)
    time.sleep(600)
    return dg.MaterializeResult()


@accelerator_asset("1", deps=[], kinds={"python"})
def needs_the_accelerator(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    return dg.MaterializeResult()


defs = dg.Definitions(
    assets=[holds_the_accelerator, serves_on_the_accelerator, needs_the_accelerator],
    executor=step_executor(),
)


def _home(tmp_path: Path) -> Path:
    """A Dagster home with the repo's instance config: accelerator pool limit 1."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copyfile(REPO / "dagster.yaml", home / "dagster.yaml")
    return home


def _claimed(instance: dg.DagsterInstance) -> list[str]:
    info = instance.event_log_storage.get_concurrency_info(ACCELERATOR_POOL)
    return [slot.run_id for slot in info.claimed_slots if slot.run_id]


def _materialize(asset: str) -> list[str]:
    return [str(BIN / "dagster"), "asset", "materialize", "-m", "tests.test_pool",
            "--partition", PARTITION, "--select", asset]  # fmt: skip


def _holding(instance: dg.DagsterInstance, asset: str) -> bool:
    """Whether a run holds the slot and its step has started (and started its server)."""
    for run_id in _claimed(instance):
        if instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_START):
            return asset != "serves_on_the_accelerator" or bool(processes.processes_of(run_id))
    return False


def _killed_while_holding(asset: str, tmp_path: Path) -> tuple[dict, dg.DagsterInstance, str]:
    """Materialize `asset` from the CLI until its step holds the accelerator's slot, then
    SIGKILL the CLI's process group, as the OOM killer or a preempted node would. Returns
    the environment of that Dagster home, its instance and the dead run's id."""
    home = _home(tmp_path)
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    instance = dg.DagsterInstance.local_temp(str(home))
    log = open(tmp_path / "holder.log", "wb")  # noqa: SIM115 - closed below
    holder = subprocess.Popen(_materialize(asset), cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not _holding(instance, asset) and holder.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    log.close()
    assert _claimed(instance), (tmp_path / "holder.log").read_text()[-3000:]
    (dead,) = _claimed(instance)
    assert instance.get_run_by_id(dead).status == dg.DagsterRunStatus.STARTED  # the bug's state
    return env, instance, dead


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["dagster asset materialize", "dg.materialize"])
def test_a_run_killed_holding_the_accelerator_frees_it_for_the_next(
    tmp_path: Path, launch: str
) -> None:
    """The next run's step starts within a minute, from the CLI (the code location's
    executor) or from Python (Dagster's in-process executor, as the demo's runs)."""
    env, instance, dead = _killed_while_holding("holds_the_accelerator", tmp_path)
    launched = time.time()
    if launch == "dg.materialize":
        assets = [needs_the_accelerator]
        assert dg.materialize(assets, instance=instance, partition_key=PARTITION).success
    else:
        proc = subprocess.run(_materialize("needs_the_accelerator"), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=240)  # fmt: skip
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert f"Freed the slots of run {dead}" in proc.stdout + proc.stderr
    (waiting,) = [r for r in instance.get_runs() if r.run_id != dead]
    starts = instance.all_logs(waiting.run_id, of_type=dg.DagsterEventType.STEP_START)
    assert starts and starts[0].timestamp - launched < 60
    messages = [e.user_message for e in instance.all_logs(waiting.run_id)]
    assert any(m.startswith(f"Freed the slots of run {dead}") and "is gone" in m for m in messages)
    assert instance.get_run_by_id(dead).status == dg.DagsterRunStatus.FAILURE
    assert instance.get_run_by_id(waiting.run_id).status == dg.DagsterRunStatus.SUCCESS
    assert not _claimed(instance)


@pytest.mark.slow
def test_a_server_the_killed_run_left_is_stopped_by_the_next_run(tmp_path: Path) -> None:
    """The killed worker's "server" lives on in its own session: the next run's watch
    stops it, frees the slot and its step starts, within a minute."""
    env, instance, dead = _killed_while_holding("serves_on_the_accelerator", tmp_path)
    (marked,) = processes.processes_of(dead)
    server = marked.id.pid
    started = time.monotonic()
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    waiting = subprocess.Popen(_materialize("needs_the_accelerator"), cwd=REPO, env=env, **pipe)
    try:
        out, _ = waiting.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGKILL)
    assert waiting.returncode == 0, out[-3000:]
    assert time.monotonic() - started < 60
    assert f"pid {server}" in out and "Stopping them" in out
    assert f"Freed the slots of run {dead}" in out
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == "zombie"
    assert instance.get_run_by_id(dead).status == dg.DagsterRunStatus.FAILURE


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)

    def warning(self, msg: str) -> None:
        self.lines.append(msg)


def _started_run(instance: dg.DagsterInstance) -> dg.DagsterRun:
    run = dg.DagsterRun("a_job", run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED)
    return instance.add_run(run)


def _held_slot(home: Path) -> tuple[dg.DagsterInstance, dg.DagsterRun, dg.DagsterRun]:
    """An instance where one run holds the accelerator's only slot and another waits."""
    home.mkdir()
    shutil.copyfile(REPO / "dagster.yaml", home / "dagster.yaml")
    instance = dg.DagsterInstance.local_temp(str(home))
    storage = instance.event_log_storage
    storage.set_concurrency_slots(ACCELERATOR_POOL, 1)
    holder, waiting = _started_run(instance), _started_run(instance)
    assert storage.claim_concurrency_slot(ACCELERATOR_POOL, holder.run_id, "hold").is_claimed
    assert not storage.claim_concurrency_slot(ACCELERATOR_POOL, waiting.run_id, "need").is_claimed
    return instance, holder, waiting


def _record(instance: dg.DagsterInstance, run: dg.DagsterRun, worker: ProcessId) -> None:
    dead_runs.record_worker(instance, run.run_id, worker)


def _dead() -> ProcessId:
    """A process that ran here and is gone."""
    child = subprocess.Popen(["true"])
    created = psutil.Process(child.pid).create_time()
    child.wait()
    return ProcessId(Machine.this(), child.pid, created)


def _marked(run: dg.DagsterRun, by: ProcessId) -> dict[str, str]:
    """The environment of a process `by` started for `run`."""
    return {**os.environ, RUN_ENV: RunMark(run.run_id, by).encode()}


ELSEWHERE = Machine("another-host", "boot", "pid:[1]")


def test_a_holder_not_known_dead_is_named_and_kept(tmp_path: Path) -> None:
    """A holder that recorded nothing, or ran on another machine, is named once with the
    command that frees it; one alive here is waited for. None loses its slot."""
    instance, holder, waiting = _held_slot(tmp_path / "home")
    log = _Log()
    watch = dead_runs.PoolWatch(instance, waiting, [ACCELERATOR_POOL], log)
    watch.sweep()
    watch.sweep()
    assert len(log.lines) == 1 and dead_runs.release_command(holder.run_id) in log.lines[0]
    _record(instance, holder, ProcessId(ELSEWHERE, os.getpid(), time.time()))
    verdict = dead_runs.judge(instance, holder.run_id)
    assert verdict.action == "ask" and "another-host" in verdict.reason
    _record(instance, holder, ProcessId.this())
    assert dead_runs.judge(instance, holder.run_id).action == "wait"  # this process lives
    watch.sweep()
    assert _claimed(instance) == [holder.run_id]
    assert instance.get_run_by_id(holder.run_id).status == dg.DagsterRunStatus.STARTED


def test_a_holder_dead_here_is_failed_and_its_slot_handed_on(tmp_path: Path) -> None:
    instance, holder, waiting = _held_slot(tmp_path / "home")
    _record(instance, holder, _dead())
    log = _Log()
    dead_runs.PoolWatch(instance, waiting, [ACCELERATOR_POOL], log).sweep()
    assert instance.get_run_by_id(holder.run_id).status == dg.DagsterRunStatus.FAILURE
    assert log.lines[-1].startswith(f"Freed the slots of run {holder.run_id}")
    storage = instance.event_log_storage
    assert storage.claim_concurrency_slot(ACCELERATOR_POOL, waiting.run_id, "need").is_claimed


def test_what_a_dead_worker_left_running_is_stopped_and_its_slot_handed_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes the holder's dead worker started (an orphaned step process, one that
    ignores SIGTERM) outlive the worker, and so does the server the step started (in its
    own session): the watch stops them all, the server once the step is gone, and frees
    the slot in the same sweep, naming what it stopped."""
    instance, holder, waiting = _held_slot(tmp_path / "home")
    log, other = _Log(), _started_run(instance)
    with dead_runs.watching(instance, other, [ACCELERATOR_POOL], log):
        mark = RunMark(other.run_id, ProcessId.this())  # what a worker's children inherit
        assert RunMark.decode(os.environ[RUN_ENV]) == mark
    assert RUN_ENV not in os.environ
    worker = _dead()
    step = subprocess.Popen(["sleep", "60"], env=_marked(holder, worker), start_new_session=True)
    ignores_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    stubborn = subprocess.Popen(
        [sys.executable, "-c", ignores_term + "; print('up', flush=True); time.sleep(60)"],
        env=_marked(holder, worker),
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"up\n"
    server = subprocess.Popen(
        ["sleep", "60"], env=_marked(holder, ProcessId.of(psutil.Process(step.pid)))
    )
    _record(instance, holder, worker)
    verdict = dead_runs.judge(instance, holder.run_id)
    assert verdict.action == "stop"
    assert {target.pid for target in verdict.targets} == {step.pid, stubborn.pid}
    stop = dead_runs.stop_processes
    monkeypatch.setattr(dead_runs, "stop_processes", lambda targets: stop(targets, grace_s=1.0))
    dead_runs.PoolWatch(instance, waiting, [ACCELERATOR_POOL], log).sweep()
    for process in (step, stubborn, server):  # reaped by the watch's wait (our children)
        process.wait(timeout=5)
        assert not psutil.pid_exists(process.pid)
    assert f"pid {step.pid}" in log.lines[-3] and "Stopping them" in log.lines[-3]
    assert f"pid {server.pid}" in log.lines[-2] and "Stopping them" in log.lines[-2]
    assert log.lines[-1].startswith(f"Freed the slots of run {holder.run_id}")
    assert not _claimed(instance)
    assert instance.get_run_by_id(holder.run_id).status == dg.DagsterRunStatus.FAILURE


def test_a_marked_process_of_a_run_recorded_on_another_host_is_never_signalled(
    tmp_path: Path,
) -> None:
    """Its worker (a Celery worker, a pod) may be alive there, its step's processes here:
    the watch waits, names the host, and after its patience says what to do there."""
    instance, holder, waiting = _held_slot(tmp_path / "home")
    marked = subprocess.Popen(["sleep", "60"], env=_marked(holder, _dead()))
    try:
        _record(instance, holder, ProcessId(ELSEWHERE, 4242, time.time()))
        verdict = dead_runs.judge(instance, holder.run_id)
        assert (verdict.action, verdict.elsewhere, verdict.targets) == ("ask", "another-host", ())
        log = _Log()
        watch = dead_runs.PoolWatch(instance, waiting, [ACCELERATOR_POOL], log)
        watch.patience_s = 0.0
        watch.sweep()
        watch.sweep()
        assert marked.poll() is None
        assert _claimed(instance) == [holder.run_id]
        assert instance.get_run_by_id(holder.run_id).status == dg.DagsterRunStatus.STARTED
        assert len(log.lines) == 2 and "another-host (pid 4242)" in log.lines[0]
        assert f"on another-host: `{dead_runs.release_command(holder.run_id)}`" in log.lines[1]
    finally:
        marked.kill()
        marked.wait()


def test_a_process_marked_by_a_live_process_outlives_its_runs_dead_worker(
    tmp_path: Path,
) -> None:
    """A step in a long-lived process here (a Celery worker on the run worker's machine)
    marks its server itself: while that process lives, the server is its, not an orphan."""
    instance, holder, waiting = _held_slot(tmp_path / "home")
    server = subprocess.Popen(["sleep", "60"], env=_marked(holder, ProcessId.this()))
    try:
        _record(instance, holder, _dead())
        verdict = dead_runs.judge(instance, holder.run_id)
        assert verdict.action == "wait" and f"pid {server.pid}" in verdict.reason
        dead_runs.PoolWatch(instance, waiting, [ACCELERATOR_POOL], _Log()).sweep()
        assert server.poll() is None and _claimed(instance) == [holder.run_id]
    finally:
        server.kill()
        server.wait()


def test_a_pid_now_held_by_a_newer_process_is_never_signalled() -> None:
    """The process recorded (as its worker, or found running for a dead run) is gone and
    a newer one has its pid: it is not the worker, and stopping the record spares it."""
    newer = subprocess.Popen(["sleep", "60"])
    try:
        started = psutil.Process(newer.pid).create_time()
        recorded = ProcessId(Machine.this(), newer.pid, started - 30.0)
        assert recorded.gone() and recorded.process() is None
        processes.stop_processes([recorded], grace_s=1.0)
        time.sleep(0.2)
        assert newer.poll() is None
        assert not ProcessId.this().gone() and _dead().gone()
        assert not ProcessId(ELSEWHERE, newer.pid, started - 30.0).gone()  # not known there
        processes.stop_processes([ProcessId(Machine.this(), newer.pid, started)], grace_s=1.0)
        assert not psutil.pid_exists(newer.pid)  # stopped, and reaped by the stop's wait
    finally:
        newer.kill()
        newer.wait()


def test_a_worker_record_copied_from_a_parent_run_is_not_the_runs_own(tmp_path: Path) -> None:
    """A re-executed run may carry its parent's tags; the parent's live worker must not
    make the child look alive (or dead) here."""
    instance, holder, _ = _held_slot(tmp_path / "home")
    _record(instance, holder, ProcessId.this())
    tags = instance.get_run_by_id(holder.run_id).tags
    child = dg.DagsterRun("a_job", run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED)
    child = instance.add_run(child.with_tags(tags))
    assert dead_runs.recorded_worker(child) is None
    assert dead_runs.judge(instance, child.run_id).action == "ask"


def test_release_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Refused while the worker lives here; where it is gone, what it left here is stopped
    first (on the machine the watch elsewhere names)."""
    instance, holder, _ = _held_slot(tmp_path / "home")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    _record(instance, holder, ProcessId.this())
    assert cli.main(["release", holder.run_id]) == 1  # alive here: refused
    assert "Stop it first" in capsys.readouterr().err
    assert cli.main(["release", holder.run_id, "--force"]) == 0
    assert not _claimed(instance)
    assert instance.get_run_by_id(holder.run_id).status == dg.DagsterRunStatus.FAILURE
    instance, holder, _ = _held_slot(tmp_path / "home2")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home2"))
    worker = _dead()
    left = subprocess.Popen(["sleep", "60"], env=_marked(holder, worker))
    _record(instance, holder, worker)
    assert cli.main(["release", holder.run_id]) == 0
    assert not psutil.pid_exists(left.pid) and not _claimed(instance)


def test_the_products_accelerator_steps_carry_the_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways into a run: the code location's executor (CLI, UI, daemon), in process or
    multiprocess, and a resource every accelerator asset takes (`dg.materialize`, the
    demo's `execute_in_process`)."""
    from mm_assets.definitions import defs as product

    assert wiring.is_watched(product.executor)
    for job in ("dataset_chain", "prepare", "drafts"):
        assert wiring.is_watched(product.resolve_job_def(job).executor_def)
    monkeypatch.setenv("MM_ASSETS_EXECUTOR", "multiprocess")
    assert wiring.is_watched(step_executor())
    assets = [a for a in product.assets or [] if isinstance(a, dg.AssetsDefinition)]
    in_pool = {a.key.to_user_string(): a for a in assets if a.op.pool == ACCELERATOR_POOL}
    assert set(in_pool) == {
        "target_responses",
        "hidden_states",
        "trained_speculator",
        "trained_draft",
        "speculator_benchmark",
        "draft_benchmark",
    }
    for asset in in_pool.values():
        assert asset.resource_defs[wiring.WATCH_KEY] is ACCELERATOR_WATCH
        assert wiring.WATCH_KEY in asset.required_resource_keys
