"""Chat generation through the fleet client, and greedy generations as token ids: token
ids compare exactly, so the lossless check compares them with the target's own greedy
output; the text rides along where a next turn must quote the reply."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import openai

from mm_assets.clients.media_urls import ServerAccess, outgoing_messages
from mm_assets.clients.vllm_client import RequestRefused, VllmClient
from mm_assets.common.request_settings import RequestSettings

MAX_SPECULATIVE_TOKENS = 64  # far above any depth vLLM serves; bounds a server's histogram


@dataclass(frozen=True)
class ReplyMetrics:
    """What one request cost, as this client timed it and vLLM reported it in the reply
    (`metrics`: `--enable-per-request-metrics`, `--per-request-spec-decode-metrics`)."""

    seconds: float
    """Sent to answered, as the caller waited (queueing behind other requests included)."""
    decode_s: float | None = None
    """vLLM: the first output token to the last; None when the server does not say."""
    accepted_per_position: tuple[int, ...] | None = None
    """Verifications whose first k+1 proposed tokens were accepted; None without
    speculative decoding, or when the server does not say."""
    verifications: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class ChatReply:
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: ReplyMetrics = field(default_factory=lambda: ReplyMetrics(0.0))


def reply_metrics(reported: Any, seconds: float) -> ReplyMetrics:
    """The reply's `metrics` checked: a server's answer is input, and a figure that is
    not a count (a negative, a float, a histogram longer than any depth, an accepted total
    its histogram does not add up to) refuses the request rather than enter a mean."""
    if reported is None:
        return ReplyMetrics(seconds)
    if not isinstance(reported, dict):
        raise RequestRefused("the reply's `metrics` is not an object")
    decode_ms = reported.get("generation_time_ms")
    if decode_ms is not None and not (
        isinstance(decode_ms, int | float) and math.isfinite(decode_ms) and decode_ms >= 0
    ):
        raise RequestRefused(f"the reply's generation_time_ms is not a duration: {decode_ms!r}")
    decode_s = None if decode_ms is None else decode_ms / 1000
    spec = reported.get("speculative_decoding")
    if spec is None:
        return ReplyMetrics(seconds, decode_s)
    histogram = spec.get("acceptance_histogram") if isinstance(spec, dict) else None
    accepted = spec.get("num_accepted_draft_tokens") if isinstance(spec, dict) else None
    counts = [*histogram, accepted] if isinstance(histogram, list) else []
    if (
        not counts
        or not histogram
        or len(histogram) > MAX_SPECULATIVE_TOKENS + 1
        or any(type(c) is not int or c < 0 for c in counts)
        or accepted != sum(j * c for j, c in enumerate(histogram))
    ):
        raise RequestRefused(f"the reply's speculative_decoding is not a set of counts: {spec!r}")
    # histogram[j]: verifications that accepted exactly j proposed tokens
    per_position = tuple(sum(histogram[j + 1 :]) for j in range(len(histogram) - 1))
    return ReplyMetrics(seconds, decode_s, per_position, sum(histogram), accepted)


class ChatClient(VllmClient):
    async def reply(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> ChatReply:
        """The assistant's next message for `messages`; `sampling` holds the Chat
        Completions sampling fields (temperature, top_p, seed, max_tokens)."""

        async def send(client: openai.AsyncOpenAI, model: str) -> ChatReply:
            sent = await self.inline_outside(lambda d: outgoing_messages(messages, d))
            started = time.perf_counter()
            response = await client.chat.completions.create(
                model=model,
                messages=sent,  # type: ignore[arg-type]
                extra_body={"return_token_ids": True},
                **sampling,
            )
            seconds = time.perf_counter() - started
            answer = response.model_dump()
            choice = answer["choices"][0]
            if choice.get("token_ids") is None:
                raise RequestRefused(
                    "the reply lacks token_ids; the server must be vLLM (return_token_ids)"
                )
            text = choice["message"]["content"] or ""
            metrics = reply_metrics(answer.get("metrics"), seconds)
            return ChatReply(text, list(choice["token_ids"]), choice["finish_reason"], metrics)

        return await self.call(send, lambda reply: len(reply.token_ids))


def generate_greedy_replies(
    base_url: str,
    access: ServerAccess,
    prompts: list[list[dict[str, Any]]],
    max_tokens: int = 64,
    concurrency: int = 4,
) -> list[ChatReply]:
    """Greedy replies (text and token ids) for chat prompts, in prompt order."""
    client = ChatClient([base_url], RequestSettings(concurrency=concurrency), access)
    sampling = {"max_tokens": max_tokens, "temperature": 0.0}

    async def main() -> list[ChatReply]:
        try:
            return list(await asyncio.gather(*(client.reply(p, sampling) for p in prompts)))
        finally:
            await client.close()

    return asyncio.run(main())


def generate_greedy(
    base_url: str,
    access: ServerAccess,
    prompts: list[list[dict[str, Any]]],
    max_tokens: int = 64,
    concurrency: int = 4,
) -> list[list[int]]:
    """Greedy completions (token ids) for chat prompts, in prompt order."""
    replies = generate_greedy_replies(base_url, access, prompts, max_tokens, concurrency)
    return [reply.token_ids for reply in replies]
