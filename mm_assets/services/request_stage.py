"""One request stage for every job that asks vLLM one result per row and stores it
(target responses, hidden states, online or not): every item through one `VllmClient`,
each answer to the job's writer in a storer thread, one `RequestReport` back.

Writers run in many threads at once (storing waits on the disk or on vLLM's connector,
and must not hold back the next requests), so they only return what they did: the
counts change in one place, on the event loop (`+=` from the threads loses updates).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterable, Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from mm_assets.clients.vllm_client import CircuitOpen, RequestRefused, VllmClient
from mm_assets.clients.vllm_server import unavailable
from mm_assets.common.progress import Progress
from mm_assets.common.request_settings import RequestSettings
from mm_assets.services.engine import ServerSession

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stored:
    tokens: int
    bytes: int = 0


@dataclass(frozen=True)
class Unusable:
    """Not stored, with the reason; `tokens`: what the answer counts all the same."""

    row_id: str
    reason: str
    detail: str
    tokens: int = 0


ASK_AGAIN = None  # a writer's outcome: ask for this item again (unless it was the last try)
Outcome = Stored | Unusable | None


class RequestJob(Protocol):
    what: str  # what the progress lines count
    kept: str  # what a rerun after a dead server finds
    ask_again: int  # how often an item is asked again when its writer says `ASK_AGAIN`
    workers_per_slot: int  # items in progress per request in flight (see `VllmClient.map`)

    async def ask(self, client: Any, item: Any) -> Any: ...

    def write(self, item: Any, answer: Any, final: bool) -> Outcome:
        """Store one answer (or a `RequestRefused`), in a storer thread."""


@dataclass
class RequestReport:
    """What the requests of one run did; `tokens`: of every answer, stored or not."""

    stored: int = 0
    stored_tokens: int = 0
    stored_bytes: int = 0
    tokens: int = 0
    rejections: list[dict[str, str]] = field(default_factory=list)
    requests_sent: int = 0
    servers: list[dict[str, Any]] = field(default_factory=list)  # `VllmClient.server_stats`
    seconds: float = 0.0
    startup_s: float | None = None
    server_rss_bytes: int | None = None

    @property
    def rejections_by_reason(self) -> Counter[str]:
        return Counter(r["reason"] for r in self.rejections)

    def count(self, outcome: Stored | Unusable) -> None:
        """On the event loop only (see the module's docstring)."""
        self.tokens += outcome.tokens
        if isinstance(outcome, Unusable):
            self.rejections.append(
                {"row_id": outcome.row_id, "reason": outcome.reason, "detail": outcome.detail}
            )
        else:
            self.stored += 1
            self.stored_tokens += outcome.tokens
            self.stored_bytes += outcome.bytes


async def request_all(
    client: VllmClient,
    items: Iterable[Any] | AsyncIterable[Any],
    job: RequestJob,
    report: RequestReport,
    storers: Executor,
    on_done: Callable[[Any, Stored | Unusable], None] = lambda item, outcome: None,
    total: int | None = None,
) -> None:
    """On the running loop: ask for every item and store each answer with `storers`,
    counting into `report` and telling `on_done` what became of each item; servers that
    stop answering raise `CircuitOpen`. Asynchronous `items` may wait for room (the
    online trainer's prefetch window) without holding the loop."""
    started = time.perf_counter()
    progress = Progress(logger.info, job.what, total, every_s=10.0)
    ask = functools.partial(job.ask, client)

    async def handle(item: Any, answer: Any) -> None:
        loop = asyncio.get_running_loop()
        for attempt in range(job.ask_again + 1):
            final = attempt == job.ask_again
            outcome = await loop.run_in_executor(storers, job.write, item, answer, final)
            if outcome is not ASK_AGAIN:
                break
            try:
                answer = await ask(item)
            except RequestRefused as exc:
                answer = exc
        assert outcome is not None  # the last try's writer decides
        report.count(outcome)
        on_done(item, outcome)
        rate = report.tokens / max(time.perf_counter() - started, 1e-9)
        progress.update(report.stored + len(report.rejections), f"{rate:,.0f} tok/s")

    try:
        await client.map(items, ask, handle, workers=job.workers_per_slot * client.concurrency)
    except* CircuitOpen as group:
        raise group.exceptions[0] from None


def run_requests(
    client: VllmClient, items: Iterable[Any], job: RequestJob, total: int | None = None
) -> RequestReport:
    """`request_all` on a loop of its own, with its own storers."""
    report, started = RequestReport(), time.perf_counter()

    async def main() -> None:
        try:
            await request_all(client, items, job, report, storers, total=total)
        finally:
            await client.close()

    # enough storers that waiting on a writer never holds back the next requests
    with ThreadPoolExecutor(max_workers=4 * client.concurrency) as storers:
        try:
            asyncio.run(main())
        finally:
            report.requests_sent = client.requests_sent
            report.servers = client.server_stats()
            report.seconds = time.perf_counter() - started
    return report


def run_stage(
    session: AbstractContextManager[ServerSession],
    settings: RequestSettings,
    client_type: type[VllmClient],
    job: RequestJob,
    items: Iterable[Any],
    total: int,
) -> RequestReport:
    """A step's requests: every item through the servers of `session` (entered here and
    left when they are done) with a `client_type` client; a server that stops
    answering stops the step with `ServerUnavailable` (what is stored stays)."""
    with session as served:
        if served.managed:
            server = served.managed
            how = "kept warm" if server.reused else f"started in {server.startup_seconds:.1f}s"
            logger.info("vLLM %s, log %s", how, server.log_path)
        try:
            client = client_type(served.base_urls, settings, served.access)
            report = run_requests(client, items, job, total)
        except CircuitOpen as exc:
            what = f"vLLM stopped answering: {exc}. {job.kept}; rerun to resume."
            raise unavailable(what, served.managed) from exc
        if served.managed:
            report.startup_s = served.managed.startup_seconds
            report.server_rss_bytes = served.managed.rss_bytes()
    return report
