"""Dead runs release what they hold: pool slots kept by runs whose worker is gone.

Dagster (1.13) frees a step's pool slot when the step ends in a live run worker. A worker
killed outright (SIGKILL: the OOM killer, a preempted node) frees nothing: its run stays
STARTED and keeps its slot, and every later step in that pool waits for good. With the
daemon, Dagster's own mechanisms cover it (the code server marks the run failed, run
monitoring frees the slots of ended runs); a run from the command line or from Python has
no daemon, and no run launcher checks on its worker. That case is what this module is for.

A run with a step in a pool records where its worker runs (`WORKER_TAG`) and marks the
processes it starts (`RUN_ENV`). While one of its steps waits for a slot, its worker
judges each run holding one (`judge`): the slots of an ended run, or of one whose worker
ran here and is gone, are freed. What such a run left running here (its vLLM server,
which the server's parent guard stops only when the step process itself dies, or an
orphaned step process) is stopped first: it would hold the accelerator and the slot for
good. Any other holder is named once in the log, with what to do. The watch never fails
the waiting run: waiting for a live run on another machine is what a pool is for. How
runs get the watch: `wiring.py`; freeing a slot by hand: `cli.py`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

import dagster as dg

from mm_assets.orchestration import dagster_internals as internals
from mm_assets.orchestration.processes import (
    RUN_ENV,
    Machine,
    process_alive,
    processes_of,
    stop_processes,
)

WORKER_TAG = "mm_assets/worker"
POLL_SECONDS = 5.0


class Log(Protocol):
    def info(self, msg: str) -> None: ...
    def warning(self, msg: str) -> None: ...


def release_command(run_id: str) -> str:
    return f"python -m mm_assets.orchestration release {run_id}"


@dataclass(frozen=True)
class Worker:
    """A run's worker process, as recorded in the run's tags."""

    pid: int
    recorded_at: float
    machine: Machine


def record_worker(instance: dg.DagsterInstance, run_id: str, worker: Worker) -> None:
    value = {"run_id": run_id, "pid": worker.pid, "recorded_at": worker.recorded_at}
    value.update(asdict(worker.machine))
    internals.tag_run(instance, run_id, {WORKER_TAG: json.dumps(value, sort_keys=True)})


def recorded_worker(run: dg.DagsterRun) -> Worker | None:
    """The worker `run` recorded; None where it recorded none. A re-executed run may carry
    its parent's tags: a record names the run it was made for."""
    try:
        value = json.loads(run.tags[WORKER_TAG])
        if value["run_id"] != run.run_id:
            return None
        machine = Machine(value["host"], value["boot"], value["pid_namespace"])
        return Worker(int(value["pid"]), float(value["recorded_at"]), machine)
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Verdict:
    """What to do about a run that holds a slot: `free` it (ended, deleted or dead here),
    `wait` for it (alive here), `stop` what it left running here (its worker is gone),
    or `ask` whether it still runs (elsewhere, or nothing recorded)."""

    action: Literal["free", "wait", "stop", "ask"]
    reason: str
    mark_failed: bool = False
    pids: tuple[int, ...] = ()  # of the processes to stop, when `stop`


def judge(instance: dg.DagsterInstance, run_id: str) -> Verdict:
    run = instance.get_run_by_id(run_id)
    if run is None:
        return Verdict("free", "it no longer exists in this instance")
    worker = recorded_worker(run)
    here = Machine.this()
    ran_here = worker is not None and worker.machine == here
    if worker is not None and ran_here and process_alive(worker.pid, worker.recorded_at):
        return Verdict("wait", f"its worker (pid {worker.pid} on this machine) is alive")
    left = processes_of(run_id)
    if left:
        listed = "; ".join(f"pid {pid} ({command})" for pid, command in left)
        return Verdict(
            "stop",
            f"its worker is gone, but processes it started still run here and may hold the "
            f"accelerator: {listed}",
            pids=tuple(pid for pid, _ in left),
        )
    if run.is_finished:
        return Verdict("free", f"it ended ({run.status.value}) without freeing them")
    if worker is not None and ran_here:
        return Verdict(
            "free",
            f"its worker (pid {worker.pid} on {here.host}) is gone, killed while it held the "
            "slot (SIGKILL: the OOM killer, a preempted node?)",
            mark_failed=True,
        )
    if worker is not None:
        where = worker.machine.host
        return Verdict("ask", f"its worker ran on {where}, which cannot be checked from here")
    return Verdict("ask", "it recorded no machine, so whether its worker lives is unknown")


def release(instance: dg.DagsterInstance, run_id: str, verdict: Verdict, by: str) -> None:
    """Mark the run failed (where the verdict says it only looks in progress) and free all
    its slots; `by` says who did, for the failed run's log."""
    run = instance.get_run_by_id(run_id)
    if verdict.mark_failed and run is not None and not run.is_finished:
        message = f"Marked failed by {by}: {verdict.reason}. Its pool slots were freed."
        internals.mark_run_failed(instance, run, message)
    internals.free_slots_of_run(instance, run_id)


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

    def holders(self) -> dict[str, tuple[str, str]]:
        """Runs that hold (or were handed) a slot in a pool where a step of this run waits:
        {holder run id: (pool, step)}; empty while no step of the run waits."""
        holders: dict[str, tuple[str, str]] = {}
        for pool in self.pools:
            queue = internals.pool_queue(self.instance, pool)
            if not any(waiting == self.run.run_id for waiting, _ in queue.waiting):
                continue
            for holder, step in queue.holding:
                if holder and holder != self.run.run_id:
                    holders.setdefault(holder, (pool, step))
        return holders

    def sweep(self) -> None:
        for holder, (pool, step) in self.holders().items():
            verdict = judge(self.instance, holder)
            if verdict.action == "stop":
                self.log.warning(
                    f"Run {holder} holds a slot of pool '{pool}': {verdict.reason}. "
                    "Stopping them (SIGTERM, then SIGKILL)."
                )
                stop_processes(verdict.pids)
                verdict = judge(self.instance, holder)
            if verdict.action == "free":
                release(self.instance, holder, verdict, f"run {self.run.run_id}, waiting on it")
                failed = " Marked it failed." if verdict.mark_failed else ""
                self.log.warning(
                    f"Freed the slots of run {holder}: {verdict.reason}.{failed} This run's "
                    f"step waiting on pool '{pool}' goes on."
                )
                continue
            say = f"Waiting: run {holder} holds a slot of pool '{pool}' (step {step}); "
            say += f"{verdict.reason}."
            if verdict.action == "stop":
                pids = " ".join(map(str, verdict.pids))
                say += f" They did not stop; stop them (`kill -9 {pids}`): this run then goes on."
            elif verdict.action == "ask":
                say += (
                    f" If that run is no longer running, free its slot: `{release_command(holder)}`"
                    " (or in the UI: terminate the run, then 'Free concurrency slots' in its menu)."
                )
            level = self.log.info if verdict.action == "wait" else self.log.warning
            self._say_once(f"{holder} {verdict.action}", say, level)

    def _say_once(self, key: str, message: str, say: Callable[[str], None]) -> None:
        if key not in self._said:
            self._said.add(key)
            say(message)


@contextmanager
def watching(
    instance: dg.DagsterInstance | None, run: dg.DagsterRun | None, pools: Iterable[str], log: Log
) -> Iterator[None]:
    """Record this worker and watch `pools` for the run, once per run. Where the run already
    recorded its worker (the worker entering again, through both ways in `wiring.py`, or a
    step process of the multiprocess, Celery or Kubernetes executor) this only marks the
    process's children: the worker watches."""
    pools = sorted(set(pools))
    if instance is None or run is None or not pools or not internals.supports_pools(instance):
        yield
        return
    inherited = os.environ.get(RUN_ENV)
    os.environ[RUN_ENV] = run.run_id  # inherited by the processes the run's steps start here
    try:
        if recorded_worker(instance.get_run_by_id(run.run_id) or run) is not None:
            yield
            return
        record_worker(instance, run.run_id, Worker(os.getpid(), time.time(), Machine.this()))
        with PoolWatch(instance, run, pools, log):
            yield
    finally:
        if inherited is None:
            os.environ.pop(RUN_ENV, None)
        else:
            os.environ[RUN_ENV] = inherited
