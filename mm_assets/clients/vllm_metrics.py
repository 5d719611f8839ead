"""Spec-decode counters of a vLLM server, read from its Prometheus `/metrics`.

The change of these counters over a set of generations gives the acceptance length
(`1 + accepted / drafts`) and the per-position acceptance rates of the served draft.
The exposition is parsed by `prometheus_client`, the library vLLM writes it with.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecDecodeCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: list[float]

    def minus(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        positions = zip(self.accepted_per_position, before.accepted_per_position, strict=False)
        return SpecDecodeCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            [a - b for a, b in positions],
        )

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def per_position_rates(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]


def counters_from_metrics_text(text: str) -> SpecDecodeCounters:
    """The spec-decode counters in a Prometheus text exposition, summed over every other
    label (engine, model name). Only the counter samples count (`name` or `name_total`),
    not their `_created` timestamps; a server without a draft gives zeros."""
    totals = dict.fromkeys((DRAFTS, DRAFT_TOKENS, ACCEPTED), 0.0)
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in totals:
                totals[name] += sample.value
            elif name == ACCEPTED_PER_POSITION and "position" in sample.labels:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
    return SpecDecodeCounters(
        totals[DRAFTS],
        totals[DRAFT_TOKENS],
        totals[ACCEPTED],
        [per_position.get(p, 0.0) for p in range(max(per_position, default=-1) + 1)],
    )


def spec_decode_counters(base_url: str) -> SpecDecodeCounters:
    """The counters now, from `<root>/metrics` of an OpenAI-compatible base URL."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:
        return counters_from_metrics_text(response.read().decode())
