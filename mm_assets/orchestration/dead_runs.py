"""Dead runs release what they hold: pool slots kept by runs whose worker is gone.

Dagster (1.13) frees a step's pool slot when the step ends in a live run worker; a worker
killed outright (SIGKILL: the OOM killer, a preempted node) keeps its run STARTED and its
slot, and every later step in that pool waits for good. The daemon covers this; a run from
the command line or from Python has none, which is what this module is for.

A pooled run records its worker (`WORKER_TAG`) and marks the processes it starts
(`RUN_ENV`). While one of its steps waits for a slot, its worker judges each holder
(`judge`): the slots of an ended run, or of one whose worker ran here and is gone, are
freed, after stopping what it left running here (its vLLM server would hold the
accelerator). Nothing else is signalled: a run recorded on another machine may be alive
there. Every other holder is named in the log with what to do; the waiting run never
fails. How runs get the watch: `wiring.py`; freeing a slot by hand: `cli.py`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Protocol

import dagster as dg

from mm_assets.orchestration import dagster_internals as internals
from mm_assets.orchestration.processes import (
    RUN_ENV,
    ProcessId,
    RunMark,
    processes_of,
    stop_processes,
)

WORKER_TAG = "mm_assets/worker"
POLL_SECONDS = 5.0
ELSEWHERE_PATIENCE_S = 600.0  # then the log says what to do on the holder's machine
STOP_ROUNDS = 3  # a server its step marked is an orphan once the step is stopped


class Log(Protocol):
    def info(self, msg: str) -> None: ...
    def warning(self, msg: str) -> None: ...


def release_command(run_id: str) -> str:
    return f"python -m mm_assets.orchestration release {run_id}"


def record_worker(instance: dg.DagsterInstance, run_id: str, worker: ProcessId) -> None:
    internals.tag_run(instance, run_id, {WORKER_TAG: RunMark(run_id, worker).encode()})


def recorded_worker(run: dg.DagsterRun) -> ProcessId | None:
    """The worker `run` recorded; None where it recorded none. A re-executed run may carry
    its parent's tags: a record names the run it was made for."""
    mark = RunMark.decode(run.tags.get(WORKER_TAG))
    return mark.by if mark is not None and mark.run_id == run.run_id else None


@dataclass(frozen=True)
class Verdict:
    """What to do about a run that holds a slot: `free` it (ended, deleted or dead here),
    `wait` for it (alive here), `stop` what it left running here (its worker and whatever
    marked them are gone from here), or `ask` whether it still runs (on `elsewhere`, the
    worker's host, or nothing recorded)."""

    action: Literal["free", "wait", "stop", "ask"]
    reason: str
    mark_failed: bool = False
    targets: tuple[ProcessId, ...] = ()  # the processes to stop, when `stop`
    elsewhere: str = ""


def judge(instance: dg.DagsterInstance, run_id: str) -> Verdict:
    run = instance.get_run_by_id(run_id)
    if run is None:
        return Verdict("free", "it no longer exists in this instance")
    worker = recorded_worker(run)
    if worker is None or not worker.here():
        if run.is_finished:  # its slots only: nothing is signalled for it
            return Verdict("free", f"it ended ({run.status.value}) without freeing them")
        if worker is None:
            return Verdict("ask", "it recorded no worker, so whether it lives is unknown")
        host = worker.machine.host
        return Verdict(
            "ask",
            f"its worker runs on {host} (pid {worker.pid}), which cannot be checked from here;"
            " nothing here is stopped for it",
            elsewhere=host,
        )
    if not worker.gone():
        return Verdict("wait", f"its worker (pid {worker.pid} on this machine) is alive")
    left = processes_of(run_id)
    orphans = [marked for marked in left if marked.by.gone()]
    if orphans:
        listed = "; ".join(f"pid {m.id.pid} ({m.command})" for m in orphans)
        return Verdict(
            "stop",
            f"its worker is gone, but processes it started still run here and may hold the "
            f"accelerator: {listed}",
            targets=tuple(marked.id for marked in orphans),
        )
    if left:
        listed = "; ".join(f"pid {m.id.pid}, marked by pid {m.by.pid}" for m in left)
        return Verdict("wait", f"its worker is gone, but live processes still run it: {listed}")
    if run.is_finished:
        return Verdict("free", f"it ended ({run.status.value}) without freeing them")
    return Verdict(
        "free",
        f"its worker (pid {worker.pid} on {worker.machine.host}) is gone, killed while it held "
        "the slot (SIGKILL: the OOM killer, a preempted node?)",
        mark_failed=True,
    )


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
        self.patience_s = ELSEWHERE_PATIENCE_S
        self._said: set[str] = set()
        self._seen: dict[str, float] = {}  # when a holder elsewhere was first seen
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
            for _ in range(STOP_ROUNDS):
                if verdict.action != "stop":
                    break
                self.log.warning(
                    f"Run {holder} holds a slot of pool '{pool}': {verdict.reason}. "
                    "Stopping them (SIGTERM, then SIGKILL)."
                )
                stop_processes(verdict.targets)
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
                pids = " ".join(str(target.pid) for target in verdict.targets)
                say += f" They did not stop; stop them (`kill -9 {pids}`): this run then goes on."
            elif verdict.action == "ask" and not verdict.elsewhere:
                say += (
                    f" If that run is no longer running, free its slot: `{release_command(holder)}`"
                    " (or in the UI: terminate the run, then 'Free concurrency slots' in its menu)."
                )
            waits = verdict.action == "wait" or bool(verdict.elsewhere)
            level = self.log.info if waits else self.log.warning
            self._say_once(f"{holder} {verdict.action}", say, level)
            if verdict.elsewhere:
                self._patience_with(holder, pool, verdict.elsewhere)

    def _patience_with(self, holder: str, pool: str, host: str) -> None:
        """Wait for a holder whose worker runs on `host`; once it has held the slot for
        `ELSEWHERE_PATIENCE_S`, say what to do there (only there can it be judged)."""
        seen = self._seen.setdefault(holder, time.monotonic())
        if time.monotonic() - seen < self.patience_s:
            return
        self._say_once(
            f"{holder} patience",
            f"Run {holder} has held a slot of pool '{pool}' for {self.patience_s / 60:.0f} min "
            f"or more, from {host}. If it no longer runs there, on {host}: "
            f"`{release_command(holder)}` (there it stops what the run left and frees the "
            "slot once its worker is gone). Nothing here is stopped for it.",
            self.log.warning,
        )

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
    inherited, this = os.environ.get(RUN_ENV), ProcessId.this()
    # inherited by the processes the run's steps start here, naming this one
    os.environ[RUN_ENV] = RunMark(run.run_id, this).encode()
    try:
        if recorded_worker(instance.get_run_by_id(run.run_id) or run) is not None:
            yield
            return
        record_worker(instance, run.run_id, this)
        with PoolWatch(instance, run, pools, log):
            yield
    finally:
        if inherited is None:
            os.environ.pop(RUN_ENV, None)
        else:
            os.environ[RUN_ENV] = inherited
