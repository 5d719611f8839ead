"""Requests to vLLM servers through the `openai` client: hidden-state extraction and
chat generation, spread over one or more servers.

Extraction sends every row as its token ids, so the hidden states belong to exactly the
tokens the trainer reads. Text rows go to Completions; rows with images to the token-in
route `/inference/v1/generate` (`--enable-scale-out`), each image's placeholder run
collapsed to one token (vLLM expands it again through the model's processor). Both
return the prompt token ids, which the caller compares with the stored ones.
Generation asks Chat Completions for the generated token ids (`return_token_ids`).

Transient failures (connection, timeout, 5xx, 429) are retried, on another server when
there is one; a 4xx is a per-sample failure. A server that fails `breaker_failures` tries
in a row leaves rotation while another remains, and gets a probe request after
`probe_after_s`. When `breaker_failures` requests in a row have failed every try, the
circuit opens and the run stops (what was stored so far is kept for the next run).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai

from mm_assets.clients.media_urls import ServerAccess, outgoing_url
from mm_assets.common.request_settings import RequestSettings
from mm_assets.common.urls import shown_url

logger = logging.getLogger(__name__)
Item = TypeVar("Item")
Result = TypeVar("Result")
DEFAULT = RequestSettings()
NO_ACCESS = ServerAccess()
TOKEN_IN_PATH = "/inference/v1/generate"
TRANSIENT = (
    openai.APIConnectionError,
    openai.APITimeoutError,
    openai.InternalServerError,
    openai.RateLimitError,
)


@dataclass(frozen=True)
class ExtractionRequest:
    row_id: str
    input_ids: list[int]
    image_urls: tuple[str, ...] = ()  # `file://` URLs, in order
    prompt_ids: list[int] | None = None  # with images: each placeholder run collapsed

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class ExtractionResponse:
    prompt_token_ids: list[int]
    hidden_states_path: str


class RequestRefused(Exception):
    """The server refused this request (4xx: `status`) or answered without what was asked."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class CircuitOpen(RuntimeError):
    """Requests keep failing every try on every server: none is reachable."""


@dataclass
class ServerStats:
    """One server's share of a run, for the step's metadata."""

    url: str  # as shown (`shown_url`: no password)
    answered: int = 0  # refusals included: the server was up
    failed_tries: int = 0  # transient errors
    taken_out: int = 0
    tokens: int = 0  # prompt tokens for extraction, generated tokens for chat


def parse_response(payload: dict[str, Any]) -> ExtractionResponse:
    """Prompt token ids and hidden-states path from a Completions or Chat response."""
    prompt_ids = payload.get("prompt_token_ids")
    if prompt_ids is None and payload.get("choices"):
        prompt_ids = payload["choices"][0].get("prompt_token_ids")
    params = payload.get("kv_transfer_params") or {}
    path = params.get("hidden_states_path")
    if prompt_ids is None or path is None:
        raise RequestRefused(
            "response lacks prompt_token_ids or kv_transfer_params.hidden_states_path; is "
            "the server running with the extract_hidden_states method and the connector?"
        )
    return ExtractionResponse(list(prompt_ids), path)


def token_in_url(base_url: httpx.URL) -> httpx.URL:
    """The token-in route beside an OpenAI base URL (`…/v1`): under the same path prefix,
    so a server behind a gateway (`https://gw/team-a/v1`) is asked at `/team-a/inference/…`."""
    prefix = base_url.path.rstrip("/").removesuffix("/v1")
    return base_url.copy_with(path=prefix + TOKEN_IN_PATH)


class _Server:
    def __init__(
        self, url: str, api_key: str, timeout_s: float, http: httpx.AsyncClient | None
    ) -> None:
        self.client = openai.AsyncOpenAI(  # max_retries=0: `VllmClient.call` retries
            base_url=url, api_key=api_key, timeout=timeout_s, max_retries=0, http_client=http
        )
        self.in_flight = 0
        self.model: str | None = None
        self.failed_in_a_row = 0
        self.last_error = ""
        self.out_until: float | None = None  # out of rotation until then; None: in it
        self.stats = ServerStats(shown_url(url))

    async def model_name(self) -> str:
        if self.model is None:
            models = await self.client.models.list()
            self.model = models.data[0].id
        return self.model


class VllmClient:
    """Requests spread over vLLM servers, the least busy first. `http_client` replaces the
    `openai` client's own (tests); `backoff_s` is the first retry's mean wait when no
    other server can take it, doubling with each further try."""

    clock: Callable[[], float] = staticmethod(time.monotonic)  # tests set their own

    def __init__(
        self,
        base_urls: Sequence[str],
        settings: RequestSettings = DEFAULT,
        access: ServerAccess = NO_ACCESS,
        http_client: httpx.AsyncClient | None = None,
        backoff_s: float = 0.5,
    ) -> None:
        if not base_urls:
            raise ValueError("no vLLM base URL to send requests to")
        timeout_s = settings.request_timeout_s
        self.servers = [_Server(url, access.api_key, timeout_s, http_client) for url in base_urls]
        self.media_dir = access.media_dir
        self.concurrency = settings.concurrency
        self.in_flight = asyncio.Semaphore(settings.concurrency)
        self.max_retries = settings.max_retries
        self.backoff_s = backoff_s
        self.breaker_failures = settings.breaker_failures
        self.probe_after_s = settings.probe_after_s
        self.requests_sent = 0
        self._given_up_in_a_row = 0

    def server_stats(self) -> list[dict[str, Any]]:
        """Each server's share so far, and whether it is in rotation now."""
        return [{**asdict(s.stats), "in_rotation": s.out_until is None} for s in self.servers]

    def _candidates(self) -> list[_Server]:
        """Servers in rotation, and those out of it due for a probe that none is sending."""
        in_rotation = [s for s in self.servers if s.out_until is None]
        now = self.clock()
        due = [s for s in self.servers if s.out_until is not None and now >= s.out_until]
        probes = [s for s in due if s.in_flight == 0]
        return probes + in_rotation  # a probe first: `_pick` takes the first of equals

    def _pick(self, tried: set[_Server]) -> _Server:
        """The least busy candidate, one this request has not failed on if there is one."""
        candidates = self._candidates()
        fresh = [s for s in candidates if s not in tried] or candidates
        return min(fresh, key=lambda s: s.in_flight)

    def _failed(self, server: _Server, exc: Exception) -> None:
        server.failed_in_a_row += 1
        server.stats.failed_tries += 1
        server.last_error = f"{type(exc).__name__}: {exc}"
        probing = server.out_until is not None
        others = any(s.out_until is None for s in self.servers if s is not server)
        if probing or (others and server.failed_in_a_row >= self.breaker_failures):
            server.out_until = self.clock() + self.probe_after_s
        if not probing and server.out_until is not None:
            server.stats.taken_out += 1
            logger.warning(
                f"vLLM server {server.stats.url} taken out of rotation after "
                f"{server.failed_in_a_row} failed tries in a row ({server.last_error}); "
                f"its requests go to the others, a probe in {self.probe_after_s:.0f}s"
            )

    def _answered(self, server: _Server, tokens: int) -> None:
        server.failed_in_a_row = 0
        server.stats.answered += 1
        server.stats.tokens += tokens
        if server.out_until is not None:
            server.out_until = None
            logger.info(f"vLLM server {server.stats.url} answers again: back in rotation")

    async def call(
        self, send: Callable[[Any, str], Awaitable[Result]], tokens: Callable[[Result], int]
    ) -> Result:
        """`send(openai_client, model)` on the least busy server, with retries;
        `tokens(result)` is what the answer counts in the server's stats."""
        tried: set[_Server] = set()
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if tried and not [s for s in self._candidates() if s not in tried]:
                await asyncio.sleep(
                    min(30.0, self.backoff_s * 2 ** (attempt - 1)) * (0.5 + random.random())
                )
            async with self.in_flight:
                server = self._pick(tried)
                server.in_flight += 1
                try:
                    model = await server.model_name()
                    self.requests_sent += 1
                    result = await send(server.client, model)
                except TRANSIENT as exc:
                    self._failed(server, exc)
                    tried.add(server)
                    last = exc
                    continue
                except openai.APIStatusError as exc:
                    self._answered(server, 0)
                    raise RequestRefused(
                        f"HTTP {exc.status_code}: {exc.message}", exc.status_code
                    ) from exc
                finally:
                    server.in_flight -= 1
            self._answered(server, tokens(result))
            self._given_up_in_a_row = 0
            return result
        self._given_up_in_a_row += 1
        if self._given_up_in_a_row >= self.breaker_failures:
            states = "; ".join(
                f"{s.stats.url} ({'out of rotation, ' if s.out_until is not None else ''}"
                f"{s.last_error})"
                for s in self.servers
            )
            raise CircuitOpen(
                f"{self._given_up_in_a_row} requests in a row failed all their "
                f"{self.max_retries + 1} tries: {states}. Are the vLLM servers running?"
            ) from last
        raise RequestRefused(f"gave up after {self.max_retries + 1} tries: {last}") from last

    async def map(
        self,
        items: Iterable[Item] | AsyncIterable[Item],
        work: Callable[[Item], Awaitable[Result]],
        handle: Callable[[Item, Result | Exception], Awaitable[None]],
        workers: int | None = None,
    ) -> None:
        """`work` on every item: `workers` items at a time (default `concurrency`; more let a
        slot freed between a conversation's turns go to another), `concurrency` requests in
        flight; `handle` gets each result or `RequestRefused` beside the next requests."""
        workers = workers or self.concurrency
        queue: asyncio.Queue[Item | None] = asyncio.Queue(workers * 2)
        handling = asyncio.Semaphore(workers * 4)

        async def produce() -> None:
            if isinstance(items, AsyncIterable):
                async for item in items:
                    await queue.put(item)
            else:
                for item in items:
                    await queue.put(item)
            for _ in range(workers):
                await queue.put(None)

        async def handle_and_release(item: Item, outcome: Result | Exception) -> None:
            try:
                await handle(item, outcome)
            finally:
                handling.release()

        async def worker(group: asyncio.TaskGroup) -> None:
            while (item := await queue.get()) is not None:
                try:
                    outcome: Result | Exception = await work(item)
                except RequestRefused as exc:
                    outcome = exc
                await handling.acquire()
                group.create_task(handle_and_release(item, outcome))

        async with asyncio.TaskGroup() as group:
            group.create_task(produce())
            for _ in range(workers):
                group.create_task(worker(group))

    async def inline_outside(self, convert: Callable[[Path | None], Result]) -> Result:
        """`convert(media_dir)` (a `media_urls` function, which reads images) off the event
        loop; an unreadable image fails this request, not the run."""
        try:
            return await asyncio.to_thread(convert, self.media_dir)
        except OSError as exc:
            raise RequestRefused(
                f"an image could not be read ({exc}); rerun coco_image_availability"
            ) from exc

    async def close(self) -> None:
        for server in self.servers:
            await server.client.close()


class HiddenStatesClient(VllmClient):
    """Extraction: one token each; the prompt token ids and hidden-states path back."""

    async def extract(self, request: ExtractionRequest) -> ExtractionResponse:
        async def send(client: openai.AsyncOpenAI, model: str) -> ExtractionResponse:
            if not request.image_urls:
                response: Any = await client.completions.create(
                    model=model,
                    prompt=request.input_ids,
                    max_tokens=1,
                    temperature=0.0,
                    extra_body={"return_token_ids": True},
                )
                return parse_response(response.model_dump())
            urls = await self.inline_outside(
                lambda media_dir: [outgoing_url(u, media_dir) for u in request.image_urls]
            )
            body = {
                "model": model,
                "token_ids": request.prompt_ids or request.input_ids,
                "content_parts": [{"type": "image_url", "url": u} for u in urls],
                "sampling_params": {"max_tokens": 1, "temperature": 0.0},
                "return_token_ids": True,
            }
            url = str(token_in_url(client.base_url))
            try:
                payload = await client.post(url, cast_to=httpx.Response, body=body)
            except openai.NotFoundError as exc:
                raise RequestRefused(
                    f"{shown_url(url)} not found: start the extraction servers with "
                    "--enable-scale-out (rows with images are sent as token ids through it)",
                    404,
                ) from exc
            return parse_response(payload.json())

        return await self.call(send, lambda response: request.num_tokens)
