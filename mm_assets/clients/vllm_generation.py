"""Greedy chat generations from a vLLM server, as token ids (and text).

Token ids (not text) so that two servers' outputs compare exactly: the check that
speculative decoding is lossless compares them with the target's own greedy output. The
text rides along where a next turn must quote the reply (a benchmark's second round).
The requests go through `ChatClient`, the same client (and retries) target responses use.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mm_assets.clients.vllm_client import ChatClient, ChatReply
from mm_assets.common.request_settings import RequestSettings


def generate_greedy_replies(
    base_url: str, prompts: list[list[dict[str, Any]]], max_tokens: int = 64, concurrency: int = 4
) -> list[ChatReply]:
    """Greedy replies (text and token ids) for chat prompts, in prompt order."""
    client = ChatClient(
        [base_url], RequestSettings(concurrency=concurrency)
    )  # bounds requests in flight
    sampling = {"max_tokens": max_tokens, "temperature": 0.0}

    async def main() -> list[ChatReply]:
        try:
            return list(await asyncio.gather(*(client.reply(p, sampling) for p in prompts)))
        finally:
            await client.close()

    return asyncio.run(main())


def generate_greedy(
    base_url: str, prompts: list[list[dict[str, Any]]], max_tokens: int = 64, concurrency: int = 4
) -> list[list[int]]:
    """Greedy completions (token ids) for chat prompts, in prompt order."""
    replies = generate_greedy_replies(base_url, prompts, max_tokens, concurrency)
    return [reply.token_ids for reply in replies]
