"""Dead runs release what they hold: pool slots kept by runs whose worker is gone.

Why this exists. Dagster (1.13) frees a step's pool slot when the step ends in a live run
worker. A worker killed outright (SIGKILL: the OOM killer, a preempted node) frees nothing:
its run stays STARTED in the instance and keeps its slot, and every later step in that pool
waits for good, logging "Step still blocked by limit for pool accelerator" every five
minutes. Under `dagster dev` or a daemon, the code server marks a run failed when its worker
process dies, and run monitoring frees the slots of finished runs
(`free_slots_after_run_end_seconds` in dagster.yaml). A run from the command line
(`dagster asset materialize`, `dg.materialize`, the demo) has neither, and no run launcher
checks on a CLI worker at all.

So a run with a step in a pool watches from its own worker, on a thread, while it runs:
- it records where it runs (host, boot, pid namespace, pid) as an engine event, and marks
  the processes it starts (`RUN_ENV` in their environment: a managed vLLM server runs in its
  own session and outlives a killed worker), so that a later run can tell what still runs;
- while one of its steps waits for a slot, it judges each run holding one. A run recorded on
  this machine whose processes are all gone is marked failed and its slots freed; a finished
  run's slots are freed. A run that is alive, left processes running here, runs elsewhere
  or recorded nothing is named once in the log, with what to do: the processes to stop, or
  the command that frees its slot by hand. The watch never
  fails the waiting run: waiting for a live run on another machine is what a pool is for.

The watch starts from two places, so that every entry point has it (`watching` starts it
once per run and process): the executor of the code location (`watch_pools_of`, in
`executors.py`), which covers `dagster asset materialize`, `dg launch`, `dagster dev` and the
multiprocess executor's parent process; and a resource the accelerator assets take
(`WATCH_KEY`, added by `accelerator_asset` in `partitions.py`), which covers `dg.materialize`
and `execute_in_process` (the demo): they run Dagster's in-process executor, never the code
location's, and set resources up when the run starts.

Free a slot by hand: `python -m mm_assets.assets.pool release RUN_ID`.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import dagster as dg

# Dagster's public API writes no engine event with metadata; this is the class its own
# executors use to record their pid.
from dagster._core.events import EngineEventData

from mm_assets.common import paths

WATCH_KEY = "pool_watch"
RUN_ENV = "MM_ASSETS_RUN_ID"  # set in a watched worker: the processes it starts inherit it
POLL_SECONDS = 5.0
RECORD_MESSAGE = "mm_assets: run worker"
_PID_EVENTS = {dg.DagsterEventType.ENGINE_EVENT, dg.DagsterEventType.STEP_WORKER_STARTED}


class Log(Protocol):
    def info(self, msg: str) -> None: ...
    def warning(self, msg: str) -> None: ...


def release_command(run_id: str) -> str:
    return f"python -m mm_assets.assets.pool release {run_id}"


# -- where a process runs, and whether it still does -------------------------------------


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _process_state(pid: int) -> tuple[str, float | None]:
    """The state letter and start time (epoch seconds) of a Linux process, from /proc;
    ("", None) where /proc does not tell (another OS, a vanished process)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return "", None
    fields = stat.rsplit(")", 1)[-1].split()
    boot = [line.split()[1] for line in _read("/proc/stat").splitlines() if line[:6] == "btime "]
    btime = boot[0] if boot else ""
    if not btime:
        return fields[0], None
    return fields[0], int(btime) + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def process_alive(pid: int, recorded_at: float) -> bool:
    """Whether the process `pid`, recorded at `recorded_at`, still runs. A zombie is dead;
    a process started after the record is another one that reuses the pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    state, started = _process_state(pid)
    if state in {"Z", "X"}:
        return False
    return started is None or started <= recorded_at + 1.0


def processes_of(run_id: str) -> list[tuple[int, str]]:
    """Live processes on this machine started by a worker of `run_id` (they inherited
    `RUN_ENV`), with their command: a managed vLLM server runs in its own session and
    outlives a killed worker, holding the accelerator. Empty where /proc cannot tell."""
    found = []
    needle = f"{RUN_ENV}={run_id}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        try:
            inherited = needle in (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile, or another user's
        if inherited and pid != os.getpid() and _process_state(pid)[0] not in {"Z", "X"}:
            found.append((pid, command.strip()[:60]))
    return found


@dataclass(frozen=True)
class Machine:
    """What tells two processes apart across machines, reboots and containers: the same
    pid means the same process only within one host, boot and pid namespace."""

    host: str
    boot_id: str
    pid_namespace: str

    @classmethod
    def this(cls) -> Machine:
        boot = _read("/proc/sys/kernel/random/boot_id")
        return cls(socket.gethostname(), boot, _pid_namespace())


@dataclass(frozen=True)
class Worker:
    """A process of a run, as recorded in the run's events."""

    pid: int
    recorded_at: float
    machine: Machine | None  # None: Dagster's own pid records, which name no machine

    def metadata(self) -> dict[str, Any]:
        assert self.machine is not None
        return {
            "pid": dg.MetadataValue.text(str(self.pid)),
            "host": dg.MetadataValue.text(self.machine.host),
            "boot_id": dg.MetadataValue.text(self.machine.boot_id),
            "pid_namespace": dg.MetadataValue.text(self.machine.pid_namespace),
        }


def record_worker(instance: dg.DagsterInstance, run: dg.DagsterRun) -> Worker:
    """Record this process as a worker of `run`, on this machine."""
    machine = Machine.this()
    worker = Worker(os.getpid(), time.time(), machine)
    instance.report_engine_event(
        f"{RECORD_MESSAGE} (pid {worker.pid} on {machine.host})",
        run,
        EngineEventData(metadata=worker.metadata()),
    )
    return worker


def recorded_workers(instance: dg.DagsterInstance, run_id: str) -> list[Worker]:
    """Every process the run's events name: ours (with the machine) and Dagster's own
    (`Executing steps in process (pid: N)`, `Started process for run`, step subprocesses)."""
    workers = []
    for entry in instance.all_logs(run_id, of_type=_PID_EVENTS):
        event = entry.dagster_event
        data = event.event_specific_data if event else None
        meta = data.metadata if isinstance(data, EngineEventData) else {}
        if "pid" not in meta:
            continue
        text = {k: str(v.value) for k, v in meta.items()}
        machine = None
        if event and (event.message or "").startswith(RECORD_MESSAGE) and "host" in text:
            machine = Machine(text["host"], text.get("boot_id", ""), text.get("pid_namespace", ""))
        workers.append(Worker(int(text["pid"]), entry.timestamp, machine))
    return workers


# -- judging a run that holds a slot ---------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What to do about a run that holds a slot: `free` it (finished, deleted or dead here),
    `wait` for it (alive here), ask a person to stop what it left running (`stuck`), or
    `ask` whether it still runs (elsewhere, or nothing recorded)."""

    action: Literal["free", "wait", "stuck", "ask"]
    reason: str
    mark_failed: bool = False
    pids: tuple[int, ...] = ()  # of the processes to stop, when `stuck`


def judge(instance: dg.DagsterInstance, run_id: str) -> Verdict:
    record = instance.get_run_record_by_id(run_id)
    if record is None:
        return Verdict("free", "it no longer exists in this instance")
    run = record.dagster_run
    workers = recorded_workers(instance, run_id)
    here = Machine.this()
    hosts = {w.machine for w in workers if w.machine is not None}
    ran_here = here in hosts
    alive = [w.pid for w in workers if ran_here and process_alive(w.pid, w.recorded_at)]
    if alive:
        return Verdict("wait", f"its worker (pid {alive[0]} on this machine) is alive")
    left = processes_of(run_id)
    if left:
        listed = "; ".join(f"pid {pid} ({command})" for pid, command in left)
        return Verdict(
            "stuck",
            f"its worker is gone, but processes it started still run here and may hold the "
            f"accelerator: {listed}",
            pids=tuple(pid for pid, _ in left),
        )
    if run.is_finished:
        return Verdict("free", f"it ended ({run.status.value}) without freeing them")
    if ran_here:
        pids = ", ".join(str(pid) for pid in sorted({w.pid for w in workers}))
        return Verdict(
            "free",
            f"its worker (pid {pids} on {here.host}) is gone, killed while it held the slot "
            "(SIGKILL: the OOM killer, a preempted node?)",
            mark_failed=True,
        )
    if hosts:
        where = ", ".join(sorted(m.host for m in hosts))
        return Verdict("ask", f"its worker ran on {where}, which cannot be checked from here")
    return Verdict("ask", "it recorded no machine, so whether its worker lives is unknown")


def release(instance: dg.DagsterInstance, run_id: str, verdict: Verdict, by: str) -> None:
    """Mark the run failed (where the verdict says it only looks in progress) and free all
    its slots; `by` says who did, for the failed run's log."""
    run = instance.get_run_by_id(run_id)
    if verdict.mark_failed and run is not None and not run.is_finished:
        instance.report_run_failed(
            run, f"Marked failed by {by}: {verdict.reason}. Its pool slots were freed."
        )
    instance.event_log_storage.free_concurrency_slots_for_run(run_id)


# -- the watch -------------------------------------------------------------------------


def holders_while_waiting(
    instance: dg.DagsterInstance, run_id: str, pools: Iterable[str]
) -> dict[str, tuple[str, str]]:
    """Runs that hold (or were handed) a slot in a pool where a step of `run_id` waits:
    {holder run id: (pool, step)}; empty while no step of the run waits."""
    holders: dict[str, tuple[str, str]] = {}
    for pool in pools:
        info = instance.event_log_storage.get_concurrency_info(pool)
        pending = info.pending_steps
        if not any(p.run_id == run_id and p.assigned_timestamp is None for p in pending):
            continue
        held = [(s.run_id, s.step_key) for s in info.claimed_slots]
        held += [(p.run_id, p.step_key) for p in pending if p.assigned_timestamp is not None]
        for holder, step in held:
            if holder and holder != run_id:
                holders.setdefault(holder, (pool, step))
    return holders


class PoolWatch:
    """Frees the slots of dead runs while a step of `run` waits in one of `pools`."""

    def __init__(
        self, instance: dg.DagsterInstance, run: dg.DagsterRun, pools: Sequence[str], log: Log
    ) -> None:
        self.instance, self.run, self.pools, self.log = instance, run, list(pools), log
        self._said: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mm_assets-pool-watch", daemon=True)

    def __enter__(self) -> PoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self.sweep()
            except Exception as error:  # a watch must never break the run it serves
                self._say_once("error", f"pool watch: {error!r}; will try again", self.log.info)

    def sweep(self) -> None:
        for holder, (pool, step) in holders_while_waiting(
            self.instance, self.run.run_id, self.pools
        ).items():
            verdict = judge(self.instance, holder)
            what = f"run {holder} holds a slot of pool '{pool}' (step {step})"
            if verdict.action == "free":
                release(self.instance, holder, verdict, f"run {self.run.run_id}, waiting on it")
                failed = " Marked it failed." if verdict.mark_failed else ""
                self.log.warning(
                    f"Freed the slots of run {holder}: {verdict.reason}.{failed} This run's "
                    f"step waiting on pool '{pool}' goes on."
                )
            elif verdict.action == "wait":
                say = f"Waiting: {what}; {verdict.reason}."
                self._say_once(f"{holder} wait", say, self.log.info)
            elif verdict.action == "stuck":
                pids = " ".join(map(str, verdict.pids))
                say = f"Waiting: {what}; {verdict.reason}. Stop them (`kill {pids}`): this run "
                say += "then frees the slot."
                self._say_once(f"{holder} stuck", say, self.log.warning)
            else:
                self._say_once(
                    f"{holder} ask",
                    f"Waiting: {what}; {verdict.reason}. If that run is no longer running, "
                    f"free its slot: `{release_command(holder)}` (or in the UI: terminate the "
                    "run, then 'Free concurrency slots' in its menu).",
                    self.log.warning,
                )

    def _say_once(self, key: str, message: str, say: Callable[[str], None]) -> None:
        if key not in self._said:
            self._said.add(key)
            say(message)


_WATCHED: set[str] = set()
_WATCHED_LOCK = threading.Lock()


@contextmanager
def watching(
    instance: dg.DagsterInstance | None,
    run: dg.DagsterRun | None,
    pools: Iterable[str],
    log: Log,
) -> Iterator[None]:
    """Record this worker and watch `pools` for the run, once per run and process."""
    pools = sorted(set(pools))
    if instance is None or run is None or not pools:
        yield
        return
    if not instance.event_log_storage.supports_global_concurrency_limits:
        yield
        return
    with _WATCHED_LOCK:
        first = run.run_id not in _WATCHED
        _WATCHED.add(run.run_id)
    if not first:
        yield
        return
    inherited = os.environ.get(RUN_ENV)
    os.environ[RUN_ENV] = run.run_id
    try:
        record_worker(instance, run)
        with PoolWatch(instance, run, pools, log):
            yield
    finally:
        with _WATCHED_LOCK:
            _WATCHED.discard(run.run_id)
        if inherited is None:
            os.environ.pop(RUN_ENV, None)
        else:
            os.environ[RUN_ENV] = inherited


# -- wiring: the executor and the resource ------------------------------------------------


class WatchingExecutor(dg.Executor):
    """Runs `inner` with a pool watch for the pools its plan's steps use."""

    def __init__(self, inner: dg.Executor) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        # what an executor's own loop reads from `plan_context.executor` (Celery's: app_args)
        return getattr(self.inner, name)

    @property
    def retries(self) -> Any:
        return self.inner.retries

    @property
    def step_dependency_config(self) -> Any:
        return self.inner.step_dependency_config

    def execute(self, plan_context: Any, execution_plan: Any) -> Iterator[Any]:
        steps = execution_plan.get_steps_to_execute_in_topo_order()
        pools = {step.pool for step in steps if step.pool}
        with watching(plan_context.instance, plan_context.dagster_run, pools, plan_context.log):
            yield from self.inner.execute(plan_context, execution_plan)


def watch_pools_of(executor_def: dg.ExecutorDefinition) -> dg.ExecutorDefinition:
    """`executor_def` whose executors run under a pool watch (configure it afterwards)."""
    create = executor_def.executor_creation_fn
    assert create is not None, f"executor {executor_def.name} has no creation function"

    def create_watching(init_context: dg.InitExecutorContext) -> dg.Executor:
        return WatchingExecutor(create(init_context))

    create_watching.watches_pools = True  # type: ignore[attr-defined]
    return dg.ExecutorDefinition(
        name=executor_def.name,
        config_schema=executor_def.config_schema,
        requirements=executor_def.get_requirements,
        executor_creation_fn=create_watching,
        description=executor_def.description,
    )


def is_watched(executor_def: dg.ExecutorDefinition) -> bool:
    """Whether `executor_def` came from `watch_pools_of`."""
    return bool(getattr(executor_def.executor_creation_fn, "watches_pools", False))


def watch_resource(pools: Sequence[str]) -> dg.ResourceDefinition:
    """A resource that watches `pools` for as long as a run's resources live. Assets in a
    pool carry it (`resource_defs`), so a run of them has the watch whatever the executor:
    Dagster's in-process executor sets resources up when the run starts."""

    @dg.resource(description=f"Frees slots of pools {', '.join(pools)} held by dead runs.")
    def pool_watch(context: dg.InitResourceContext) -> Iterator[None]:
        with watching(context.instance, context.run, pools, context.log):
            yield None

    return pool_watch


def taking_watch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with one more argument, the watch resource (`WATCH_KEY`), which it drops.

    Dagster sets up the resources an asset's arguments name when its run starts, and only
    those (an asset may not list resources both as arguments and in its decorator): this
    is how the runs of `dg.materialize` and `execute_in_process`, which bypass the code
    location's executor, get their watch. `fn`'s annotations are resolved here, in its own
    module (Dagster would resolve them in this one): they must not be TYPE_CHECKING-only."""
    signature = inspect.signature(fn, eval_str=True)
    watch = inspect.Parameter(
        WATCH_KEY, inspect.Parameter.KEYWORD_ONLY, annotation=dg.ResourceParam[None]
    )

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop(WATCH_KEY, None)
        return fn(*args, **kwargs)

    step.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), watch]
    )
    return step


# -- by hand -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mm_assets.assets.pool",
        description="Free the pool slots a run holds (its worker died). Uses $DAGSTER_HOME.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("release", help="mark the run failed if unfinished; free its slots")
    cmd.add_argument("run_id")
    cmd.add_argument("--force", action="store_true", help="even if its worker is alive here")
    args = parser.parse_args(argv)
    paths.ensure_dagster_home()
    instance = dg.DagsterInstance.get()
    verdict = judge(instance, args.run_id)
    if verdict.action in {"wait", "stuck"} and not args.force:
        print(
            f"run {args.run_id}: {verdict.reason}. Stop it first (or pass --force to free "
            "the slot anyway).",
            file=sys.stderr,
        )
        return 1
    by_hand = Verdict("free", verdict.reason, mark_failed=True)
    release(instance, args.run_id, by_hand, "hand (python -m mm_assets.assets.pool release)")
    print(f"run {args.run_id}: its slots are free ({verdict.reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
