"""Greedy chat generations from a vLLM server, as token ids.

Token ids (not text) so that two servers' outputs compare exactly: the check that
speculative decoding is lossless compares them with the target's own greedy output.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai


async def _generate(
    base_url: str, prompts: list[list[dict[str, Any]]], max_tokens: int, concurrency: int
) -> list[list[int]]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=2)
    model = (await client.models.list()).data[0].id
    semaphore = asyncio.Semaphore(concurrency)

    async def one(messages: list[dict[str, Any]]) -> list[int]:
        async with semaphore:
            response = await client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=0.0,
                extra_body={"return_token_ids": True},
            )
            return list(response.model_dump()["choices"][0]["token_ids"])

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await client.close()


def generate_greedy(
    base_url: str, prompts: list[list[dict[str, Any]]], max_tokens: int = 64, concurrency: int = 4
) -> list[list[int]]:
    """Greedy completions (token ids) for chat prompts."""
    return asyncio.run(_generate(base_url, prompts, max_tokens, concurrency))
