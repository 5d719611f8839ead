"""Greedy chat generations from a vLLM server, as token ids.

Token ids (not text) so that two servers' outputs compare exactly: the check that
speculative decoding is lossless compares them with the target's own greedy output.
The requests go through `ChatClient`, the same client (and retries) target responses use.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mm_assets.clients.vllm_client import ChatClient


def generate_greedy(
    base_url: str, prompts: list[list[dict[str, Any]]], max_tokens: int = 64, concurrency: int = 4
) -> list[list[int]]:
    """Greedy completions (token ids) for chat prompts, in prompt order."""
    client = ChatClient([base_url], concurrency=concurrency)  # bounds requests in flight
    sampling = {"max_tokens": max_tokens, "temperature": 0.0}

    async def main() -> list[list[int]]:
        try:
            replies = await asyncio.gather(*(client.reply(p, sampling) for p in prompts))
        finally:
            await client.close()
        return [reply.token_ids for reply in replies]

    return asyncio.run(main())
