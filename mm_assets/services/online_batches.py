"""Hidden states fetched from vLLM while the draft trains (`hidden_states: online`): what
a training run fetches (`OnlineStates`), the `BatchSource` that fetches them
(`OnlineBatches`) and what fetching took (`FetchReport`).

Stored rows come from the blob store; the others are requested as offline extraction
requests them (`HiddenStatesJob`), the next `prefetch_batches` batches in flight while
the current one trains. `online_cache: keep` stores what it fetched in the blob store
(later epochs, reruns and offline runs find it); `discard` deletes each batch's files
once it is built. Threads: the trainer's (it builds batches and deletes their files), the
event loop that runs every pass's requests, and the storers. A pass's counts change on
the loop only; the disk tally, which both sides change, under a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import shutil
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from mm_assets.clients.vllm_client import CircuitOpen, ExtractionRequest, HiddenStatesClient
from mm_assets.clients.vllm_server import ManagedVllmServer, unavailable
from mm_assets.domain.model.hidden_state_plan import plan_extraction
from mm_assets.domain.model.hidden_states import ExtractionSettings, HiddenStatesLayout
from mm_assets.domain.model.settings import OnlineSettings
from mm_assets.domain.model.training_data import Batch, SampleRef, load_batch
from mm_assets.domain.rejection import StateRejections
from mm_assets.services.engine import Serving
from mm_assets.services.extraction import (
    HiddenStatesJob,
    StatesFetch,
    check_disk_budget,
    extraction_request,
    hidden_states_layout,
    remove_if_empty,
)
from mm_assets.services.request_stage import RequestReport, Stored, Unusable, request_all
from mm_assets.services.target import TargetModel
from mm_assets.storage.blobs import BlobStore

logger = logging.getLogger(__name__)
KEPT = "The training state of the last finished epoch is kept"


class TooManyRejections(RuntimeError):
    """More of the partition's rows failed than `max_rejection_ratio` allows."""


@dataclass
class PassReport:
    """One pass over batches (an epoch, a held-out evaluation) as the fetch side saw it."""

    label: str
    rows: int = 0
    cache_hits: int = 0  # rows whose states were stored already (nothing requested)
    fetched: int = 0
    fetched_tokens: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    trainer_wait_s: float = 0.0  # the trainer waiting for states
    request_wait_s: float = 0.0  # requests waiting for the trainer (the window full)
    seconds: float = 0.0

    def line(self) -> str:
        rejected = ", ".join(f"{n} {reason}" for reason, n in self.rejected.items()) or "none"
        return (
            f"{self.label}: {self.rows} rows, {self.fetched} fetched ({self.fetched_tokens} "
            f"tokens), {self.cache_hits} stored already, rejected: {rejected}; the trainer "
            f"waited {self.trainer_wait_s:.1f}s for states, requests waited "
            f"{self.request_wait_s:.1f}s for the trainer ({self.seconds:.1f}s)"
        )


@dataclass
class FetchReport:
    """Every pass of a training run, the requests behind them, and the disk they took."""

    cache: str
    passes: list[PassReport] = field(default_factory=list)
    requests: RequestReport = field(default_factory=RequestReport)
    disk_peak_bytes: int = 0  # `discard`: the most bytes the scratch directory held at once
    largest_batch_bytes: int = 0  # the most bytes fetched for one batch


@dataclass(frozen=True)
class OnlineStates:
    """How a training run gets a partition's states online: what they are, where they
    come from, how requests are sent (its `hidden_states` settings), where they go."""

    layout: HiddenStatesLayout
    extraction: ExtractionSettings
    online: OnlineSettings
    serving: Serving
    image_token_id: int | None
    blobs: BlobStore

    @classmethod
    def for_target(
        cls,
        target: TargetModel,
        serving: Serving,
        extraction: ExtractionSettings,
        online: OnlineSettings,
        blobs: BlobStore,
    ) -> OnlineStates:
        """The states `extraction` describes (layer ids checked against the target)."""
        layout = hidden_states_layout(target, serving.engine, extraction)
        return cls(layout, extraction, online, serving, target.facts.image_token_id, blobs)

    def training_rows(
        self, rows: Sequence[dict]
    ) -> tuple[list[SampleRef], dict[str, str], dict[str, ExtractionRequest]]:
        """The tokenized `rows` as training refs (at their blob's path, stored or not),
        with each row's blob key and extraction request."""
        plan = plan_extraction(rows, self.layout, self.blobs.has)
        if self.online.online_cache == "keep":  # what is missing ends up on this disk
            check_disk_budget(plan, self.layout, self.blobs)
        keys = plan.keys()
        requests = {
            r["row_id"]: extraction_request(r, self.image_token_id)
            for r in rows
            if r["row_id"] in keys
        }
        path = {row: str(self.blobs.path(key)) for row, key in keys.items()}
        refs = [SampleRef.of(r, path[r["row_id"]]) for r in rows]
        return refs, keys, requests


@dataclass(eq=False)
class _Group:
    """One batch of a pass: where each row's states are, as they arrive."""

    serial: int
    refs: Sequence[SampleRef]
    paths: dict[str, str] = field(default_factory=dict)
    rejected: set[str] = field(default_factory=set)
    waiting: int = 0
    listed: bool = False
    scratch: list[Path] = field(default_factory=list)
    bytes: int = 0
    ready: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def settle(self) -> None:
        if self.listed and self.waiting == 0 and not self.ready.done():
            self.ready.set_result(None)


@dataclass(eq=False, frozen=True)
class _Fetch(StatesFetch):
    """One request, and the rows of the groups that wait for it (identical rows share)."""

    pending_as: tuple[int, str]  # its entry in `_Pass.pending` while it is asked
    rows: dict[_Group, list[str]] = field(default_factory=dict)


@dataclass
class _Pass:
    groups: list[_Group]
    report: PassReport
    pending: dict[tuple[int, str], _Fetch] = field(default_factory=dict)
    window: asyncio.Semaphore | None = None


class OnlineBatches:
    """A `BatchSource` that fetches states while the trainer trains; a context manager
    that holds the servers and the request loop. `keys` and `requests`: each row's, as
    `OnlineStates.training_rows` gives them."""

    def __init__(
        self, states: OnlineStates, keys: dict[str, str], requests: dict[str, ExtractionRequest]
    ) -> None:
        self.states, self.keys, self.requests = states, keys, requests
        self.report = FetchReport(states.online.online_cache)
        self._discard = states.online.online_cache == "discard"
        self._serials = itertools.count(1)
        self._rejected_rows: set[str] = set()
        self._disk_now = 0
        self._disk_lock = threading.Lock()
        self._stack = ExitStack()
        self._servers = ExitStack()  # the servers and the client, while rows are left to fetch
        self.client: HiddenStatesClient | None = None
        self.managed: ManagedVllmServer | None = None  # what a dead server's error quotes

    def __enter__(self) -> OnlineBatches:
        states, stack = self.states, self._stack
        self.scratch = states.blobs.scratch() if self._discard else None
        if self.scratch is not None:
            stack.callback(shutil.rmtree, self.scratch.dir, True)
        self.job = HiddenStatesJob(states.layout, None, "hidden states (online)", KEPT)
        self.loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self.loop.run_forever, name="online-states", daemon=True)
        thread.start()
        stack.callback(self._stop_loop, thread)
        stack.callback(self._stop_servers)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _servers_for(self, groups: Sequence[Sequence[SampleRef]]) -> None:
        """Start the servers for a pass with rows to fetch; with `keep`, stop them once
        every row of the partition is stored (their memory and cores go to training)."""
        has = self.states.blobs.has
        if self.client is None and any(not has(self.keys[r.row_id]) for g in groups for r in g):
            self._start_servers()
        elif self.client and not self._discard and all(has(k) for k in self.keys.values()):
            logger.info("every row's states are stored: the extraction servers are released")
            self._stop_servers()

    def _start_servers(self) -> None:
        states, servers = self.states, self._servers
        incoming = states.blobs.incoming_dir()
        servers.callback(remove_if_empty, incoming)
        self.job.connector = states.serving.engine.connector_files(incoming)
        session = servers.enter_context(
            states.serving.extraction_session(states.layout.layer_ids, incoming)
        )
        self.managed = session.managed
        if managed := session.managed:  # its memory, just before it stops
            self.report.requests.startup_s = managed.startup_seconds
            servers.callback(
                lambda: setattr(self.report.requests, "server_rss_bytes", managed.rss_bytes())
            )
        self.client = HiddenStatesClient(session.base_urls, states.extraction, session.access)
        # the storers go with the servers: idle threads that ran torch slowed training by
        # half (BENCHMARKS.md, online hidden states)
        self.storers = concurrent.futures.ThreadPoolExecutor(self.client.concurrency)
        servers.callback(self.storers.shutdown)

    def _stop_servers(self) -> None:
        """Close the client (its counts into the report) and stop a managed server."""
        if self.client is not None:
            requests = self.report.requests
            asyncio.run_coroutine_threadsafe(self.client.close(), self.loop).result(timeout=30)
            requests.requests_sent += self.client.requests_sent
            requests.servers += self.client.server_stats()
            self.client = None
        self._servers.close()

    def _stop_loop(self, thread: threading.Thread) -> None:
        self.report.requests.seconds = sum(p.seconds for p in self.report.passes)
        self.loop.call_soon_threadsafe(self.loop.stop)
        thread.join(timeout=30)
        self.loop.close()

    def batches(self, groups: Sequence[Sequence[SampleRef]], label: str) -> Iterator[Batch | None]:
        """Each group's batch in order, its states requested up to `prefetch_batches`
        groups ahead; rows that failed this pass are left out (None: all of them)."""
        self._servers_for(groups)
        run = _Pass([_Group(next(self._serials), g) for g in groups], PassReport(label))
        run.report.rows = sum(len(g) for g in groups)
        started = time.perf_counter()
        task = asyncio.run_coroutine_threadsafe(self._fetch(run), self.loop)
        try:
            for group in run.groups:
                waited = time.perf_counter()
                done, _ = concurrent.futures.wait(
                    [group.ready, task], return_when=concurrent.futures.FIRST_COMPLETED
                )
                if group.ready not in done:
                    task.result()  # the requests failed: raises why
                run.report.trainer_wait_s += time.perf_counter() - waited
                batch = self._build(group)
                yield batch
                assert run.window is not None
                self.loop.call_soon_threadsafe(run.window.release)
            task.result()
        except CircuitOpen as exc:
            what = (
                f"vLLM stopped answering during online training ({label}): {exc}. {KEPT}; "
                "rerun to resume."
            )
            raise unavailable(what, self.managed) from exc
        finally:
            task.cancel()
        run.report.seconds = time.perf_counter() - started
        self.report.passes.append(run.report)
        logger.info("%s", run.report.line())
        self._check(run.report)

    async def _fetch(self, run: _Pass) -> None:
        run.window = asyncio.Semaphore(self.states.online.prefetch_batches + 1)
        if self.client is None:  # every row stored: nothing will be asked
            async for _ in self._items(run):
                raise RuntimeError("a row's stored states went missing during training; rerun")
            return
        await request_all(
            self.client,
            self._items(run),
            self.job,
            self.report.requests,
            self.storers,
            on_done=lambda item, outcome: self._done(run, item, outcome),
        )

    async def _items(self, run: _Pass) -> AsyncIterator[_Fetch]:
        """The requests of each group, a group only once the window has room for it."""
        assert run.window is not None
        blobs = self.states.blobs
        for group in run.groups:
            waited = time.perf_counter()
            await run.window.acquire()
            if not all(blobs.has(self.keys[ref.row_id]) for ref in group.refs):
                run.report.request_wait_s += time.perf_counter() - waited
            for fetch in self._plan(run, group):
                yield fetch
            group.listed = True
            group.settle()

    def _plan(self, run: _Pass, group: _Group) -> Iterator[_Fetch]:
        """One request per distinct key not stored (`keep`: shared across groups too)."""
        blobs, native = self.states.blobs, self.states.layout.storage.is_native
        for ref in group.refs:
            key = self.keys[ref.row_id]
            if blobs.has(key):
                group.paths[ref.row_id] = str(blobs.path(key))
                run.report.cache_hits += 1
                continue
            scope = group.serial if self._discard else 0
            fetch = run.pending.get((scope, key))
            new = fetch is None
            if fetch is None:  # `discard`: under a name of the group's own, deleted with it
                dest, name = (
                    (self.scratch, f"{key}-{group.serial}") if self.scratch else (blobs, key)
                )
                mask = None if native else ref.loss_mask
                fetch = _Fetch(self.requests[ref.row_id], name, dest, mask, (scope, key))
                run.pending[fetch.pending_as] = fetch
            if group not in fetch.rows:
                group.waiting += 1
            fetch.rows.setdefault(group, []).append(ref.row_id)
            if new:
                yield fetch

    def _done(self, run: _Pass, fetch: _Fetch, outcome: Stored | Unusable) -> None:
        """On the loop: where the states of `fetch`'s rows are, or why they are not."""
        del run.pending[fetch.pending_as]
        path = fetch.blobs.path(fetch.key)
        if isinstance(outcome, Stored):
            run.report.fetched += 1
            run.report.fetched_tokens += outcome.tokens
        for group, rows in fetch.rows.items():
            if isinstance(outcome, Unusable):
                group.rejected.update(rows)
                self._rejected_rows.update(rows)
                run.report.rejected[outcome.reason] += len(rows)
            else:
                group.paths.update({row: str(path) for row in rows})
                group.bytes += outcome.bytes
                if self.scratch is not None:
                    group.scratch.append(path)
                    self._tally(outcome.bytes)
            group.waiting -= 1
            group.settle()

    def _tally(self, change: int) -> None:
        with self._disk_lock:
            self._disk_now += change
            self.report.disk_peak_bytes = max(self.report.disk_peak_bytes, self._disk_now)

    def _build(self, group: _Group) -> Batch | None:
        """The group's batch without its rejected rows; `discard` deletes its files."""
        refs = [
            dataclasses.replace(ref, path=group.paths[ref.row_id])
            for ref in group.refs
            if ref.row_id not in group.rejected
        ]
        try:
            return load_batch(refs) if refs else None
        finally:
            self.report.largest_batch_bytes = max(self.report.largest_batch_bytes, group.bytes)
            for path in group.scratch:
                path.unlink(missing_ok=True)
            if group.scratch:
                self._tally(-group.bytes)

    def _check(self, report: PassReport) -> None:
        """Fail as the offline check does when too many rows have failed (in any pass)."""
        judged = StateRejections(
            len(self._rejected_rows),
            len(self.keys),
            self.states.extraction.max_rejection_ratio,
            self.report.requests.rejections,
            bool(self.report.requests.rejections_by_reason.get("token_mismatch")),
        )
        if judged.too_many:
            raise TooManyRejections(
                f"{report.label}: hidden states (max_rejection_ratio): {judged.describe()} "
                f"By reason: {dict(report.rejected)}."
            )
