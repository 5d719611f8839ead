"""Measuring a trained draft where it matters: vLLM serving the target with it.

Greedy generations from held-out prompts go to a server started with the draft as its
EAGLE-3 speculator; the spec-decode counters of its Prometheus `/metrics` give the
acceptance length (`1 + accepted / drafts`) and the per-position acceptance rates.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from dataclasses import dataclass
from typing import Any

import openai

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text exposition → {(name, sorted labels): value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line.strip())
        if not match:
            continue
        labels = tuple(
            sorted(
                (k.strip(), v.strip().strip('"'))
                for k, v in (
                    p.split("=", 1) for p in (match["labels"] or "").split(",") if "=" in p
                )
            )
        )
        out[(match["name"], labels)] = float(match["value"])
    return out


@dataclass(frozen=True)
class SpecDecodeCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: list[float]

    def minus(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        return SpecDecodeCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            [
                a - b
                for a, b in zip(
                    self.accepted_per_position, before.accepted_per_position, strict=False
                )
            ],
        )

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def per_position_rates(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]


def _total(metrics: dict, name: str) -> float:
    return sum(v for (n, _), v in metrics.items() if n in (name, f"{name}_total"))


def spec_decode_counters(base_url: str) -> SpecDecodeCounters:
    root = base_url.removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:
        metrics = parse_metrics(response.read().decode())
    per_position: dict[int, float] = {}
    for (name, labels), value in metrics.items():
        if name.startswith("vllm:spec_decode_num_accepted_tokens_per_pos"):
            position = int(dict(labels).get("position", -1))
            if position >= 0:
                per_position[position] = per_position.get(position, 0.0) + value
    return SpecDecodeCounters(
        _total(metrics, "vllm:spec_decode_num_drafts"),
        _total(metrics, "vllm:spec_decode_num_draft_tokens"),
        _total(metrics, "vllm:spec_decode_num_accepted_tokens"),
        [per_position[p] for p in sorted(per_position)],
    )


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
