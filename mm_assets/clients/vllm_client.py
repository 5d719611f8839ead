"""Requests that make vLLM write a sample's hidden states, through the `openai` client.

Text rows go to Completions with their token ids as the prompt; multimodal rows go to
Chat Completions with their messages (images as `file://` URLs, rendered by vLLM with the
same chat template), without a generation prompt. Both ask for one token and for the
prompt token ids, which the caller compares with the stored ones.

Transient failures (connection, timeout, 5xx, 429) are retried with backoff; a request
the server refuses (4xx) is a per-sample failure. After too many consecutive transient
failures the circuit opens and the whole run stops: the server is gone, and what was
stored so far is kept for the next run.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai

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
    messages: list[dict[str, Any]] | None = None  # multimodal rows

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class ExtractionResponse:
    prompt_token_ids: list[int]
    hidden_states_path: str


class RequestRefused(Exception):
    """The server refused this sample (4xx) or answered without hidden states."""


class CircuitOpen(RuntimeError):
    """Too many consecutive transient failures: the server is unreachable."""


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


class _Server:
    def __init__(
        self,
        base_url: str,
        api_key: str,
        timeout_s: float,
        http_client: httpx.AsyncClient | None,
    ) -> None:
        self.client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout_s,
            max_retries=0,
            http_client=http_client,
        )
        self.in_flight = 0
        self.model: str | None = None

    async def model_name(self) -> str:
        if self.model is None:
            models = await self.client.models.list()
            self.model = models.data[0].id
        return self.model


class HiddenStatesClient:
    """Spreads extraction requests over one or more vLLM servers. `http_client` replaces
    the `openai` client's own (tests inject an `httpx.MockTransport`); `backoff_s` is the
    first retry's mean wait, doubling with each further try."""

    def __init__(
        self,
        base_urls: Sequence[str],
        concurrency: int = 8,
        timeout_s: float = 600.0,
        max_retries: int = 4,
        breaker_failures: int = 8,
        api_key: str = "EMPTY",
        http_client: httpx.AsyncClient | None = None,
        backoff_s: float = 0.5,
    ) -> None:
        if not base_urls:
            raise ValueError("no vLLM base URL to send requests to")
        self.servers = [_Server(url, api_key, timeout_s, http_client) for url in base_urls]
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.breaker_failures = breaker_failures
        self.requests_sent = 0
        self._consecutive_failures = 0

    def _pick(self) -> _Server:
        return min(self.servers, key=lambda s: s.in_flight)

    async def _send_once(self, server: _Server, request: ExtractionRequest) -> ExtractionResponse:
        model = await server.model_name()
        self.requests_sent += 1
        if request.messages is None:
            response = await server.client.completions.create(
                model=model,
                prompt=request.input_ids,
                max_tokens=1,
                temperature=0.0,
                extra_body={"return_token_ids": True},
            )
        else:
            response = await server.client.chat.completions.create(
                model=model,
                messages=request.messages,  # type: ignore[arg-type]
                max_tokens=1,
                temperature=0.0,
                extra_body={
                    "add_generation_prompt": False,
                    "continue_final_message": False,
                    "return_token_ids": True,
                },
            )
        return parse_response(response.model_dump())

    async def extract(self, request: ExtractionRequest) -> ExtractionResponse:
        """One sample, with retries on transient errors."""
        for attempt in range(self.max_retries + 1):
            server = self._pick()
            server.in_flight += 1
            try:
                result = await self._send_once(server, request)
            except TRANSIENT as exc:
                if attempt == self.max_retries:
                    self._consecutive_failures += 1
                    if self._consecutive_failures >= self.breaker_failures:
                        raise CircuitOpen(
                            f"{self._consecutive_failures} consecutive requests failed; last: "
                            f"{type(exc).__name__}: {exc}. Is the vLLM server running?"
                        ) from exc
                    raise RequestRefused(f"gave up after {attempt + 1} tries: {exc}") from exc
                await asyncio.sleep(
                    min(30.0, self.backoff_s * 2**attempt) * (0.5 + random.random())
                )
                continue
            except openai.APIStatusError as exc:
                raise RequestRefused(f"HTTP {exc.status_code}: {exc.message}") from exc
            finally:
                server.in_flight -= 1
            self._consecutive_failures = 0
            return result
        raise AssertionError("unreachable")

    async def run(
        self,
        requests: Iterable[ExtractionRequest],
        handle: Callable[[ExtractionRequest, ExtractionResponse | Exception], Awaitable[None]],
    ) -> None:
        """Send every request with at most `concurrency` in flight; `handle` gets each
        response or per-sample failure. Handling (reading and storing a file) runs beside
        the next requests instead of holding a request slot. A `CircuitOpen` stops
        everything and propagates."""
        queue: asyncio.Queue[ExtractionRequest | None] = asyncio.Queue(self.concurrency * 2)
        handling = asyncio.Semaphore(self.concurrency * 4)

        async def produce() -> None:
            for request in requests:
                await queue.put(request)
            for _ in range(self.concurrency):
                await queue.put(None)

        async def handle_and_release(
            request: ExtractionRequest, outcome: ExtractionResponse | Exception
        ) -> None:
            try:
                await handle(request, outcome)
            finally:
                handling.release()

        async def work(group: asyncio.TaskGroup) -> None:
            while (request := await queue.get()) is not None:
                try:
                    outcome: ExtractionResponse | Exception = await self.extract(request)
                except RequestRefused as exc:
                    outcome = exc
                await handling.acquire()
                group.create_task(handle_and_release(request, outcome))

        async with asyncio.TaskGroup() as group:
            group.create_task(produce())
            for _ in range(self.concurrency):
                group.create_task(work(group))

    async def close(self) -> None:
        for server in self.servers:
            await server.client.close()
