"""Chat generation through the fleet client, and greedy generations as token ids: token
ids compare exactly, so the lossless check compares them with the target's own greedy
output; the text rides along where a next turn must quote the reply."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import openai

from mm_assets.clients.media_urls import ServerAccess, outgoing_messages
from mm_assets.clients.vllm_client import RequestRefused, VllmClient
from mm_assets.common.request_settings import RequestSettings


@dataclass(frozen=True)
class ChatReply:
    text: str
    token_ids: list[int]
    finish_reason: str


class ChatClient(VllmClient):
    async def reply(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> ChatReply:
        """The assistant's next message for `messages`; `sampling` holds the Chat
        Completions sampling fields (temperature, top_p, seed, max_tokens)."""

        async def send(client: openai.AsyncOpenAI, model: str) -> ChatReply:
            sent = await self.inline_outside(lambda d: outgoing_messages(messages, d))
            response = await client.chat.completions.create(
                model=model,
                messages=sent,  # type: ignore[arg-type]
                extra_body={"return_token_ids": True},
                **sampling,
            )
            choice = response.model_dump()["choices"][0]
            if choice.get("token_ids") is None:
                raise RequestRefused(
                    "the reply lacks token_ids; the server must be vLLM (return_token_ids)"
                )
            text = choice["message"]["content"] or ""
            return ChatReply(text, list(choice["token_ids"]), choice["finish_reason"])

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
