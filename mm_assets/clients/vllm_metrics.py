"""Spec-decode and serving counters of a vLLM server, read from its Prometheus `/metrics`.

Their change over a set of generations gives the served draft's acceptance and the speed
the server measured (`domain.model.benchmark`). One scrape reads both, so a difference
of two scrapes covers exactly the same requests for every figure.
The exposition is parsed by `prometheus_client`, the library vLLM writes it with.
"""

from __future__ import annotations

import logging
import time
import urllib.request
from dataclasses import astuple, dataclass
from itertools import zip_longest

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
E2E_LATENCY = "vllm:e2e_request_latency_seconds"
TIME_PER_OUTPUT_TOKEN = "vllm:request_time_per_output_token_seconds"
SERVING_SAMPLES = (
    GENERATION_TOKENS,
    f"{E2E_LATENCY}_sum",
    f"{E2E_LATENCY}_count",
    f"{TIME_PER_OUTPUT_TOKEN}_sum",
    f"{TIME_PER_OUTPUT_TOKEN}_count",
)


@dataclass(frozen=True)
class SpecDecodeCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: list[float]

    def minus(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        # a position not exposed yet (no draft reached it before) counts as zero
        positions = zip_longest(
            self.accepted_per_position, before.accepted_per_position, fillvalue=0.0
        )
        return SpecDecodeCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            [a - b for a, b in positions],
        )


@dataclass(frozen=True)
class ServingCounters:
    """Tokens generated, and two per-request histograms' sum and count."""

    generation_tokens: float
    e2e_latency_sum_s: float
    e2e_latency_count: float
    time_per_output_token_sum_s: float
    time_per_output_token_count: float

    def minus(self, before: ServingCounters) -> ServingCounters:
        return ServingCounters(
            *(a - b for a, b in zip(astuple(self), astuple(before), strict=True))
        )


@dataclass(frozen=True)
class ServerCounters:
    """Spec-decode and serving counters from one scrape."""

    spec_decode: SpecDecodeCounters
    serving: ServingCounters

    def minus(self, before: ServerCounters) -> ServerCounters:
        return ServerCounters(
            self.spec_decode.minus(before.spec_decode), self.serving.minus(before.serving)
        )


def server_counters_from_metrics_text(text: str) -> ServerCounters:
    """The counters in a Prometheus text exposition, summed over every other label; only
    counter samples (`name`, `name_total`, a histogram's `_sum`, `_count`), no `_created`."""
    totals = dict.fromkeys((DRAFTS, DRAFT_TOKENS, ACCEPTED, *SERVING_SAMPLES), 0.0)
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in totals:
                totals[name] += sample.value
            elif name == ACCEPTED_PER_POSITION and "position" in sample.labels:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
    spec_decode = SpecDecodeCounters(
        totals[DRAFTS],
        totals[DRAFT_TOKENS],
        totals[ACCEPTED],
        [per_position.get(p, 0.0) for p in range(max(per_position, default=-1) + 1)],
    )
    return ServerCounters(spec_decode, ServingCounters(*(totals[n] for n in SERVING_SAMPLES)))


def server_counters(base_url: str) -> ServerCounters:
    """All counters now, from `<root>/metrics` of an OpenAI-compatible base URL."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:
        return server_counters_from_metrics_text(response.read().decode())


def counters_after(
    url: str, before: ServerCounters, requests: int, timeout_s: float = 30.0
) -> ServerCounters:
    """The counters once the server has counted `requests` more finished requests: vLLM
    records a request's figures beside answering it, so a scrape right after the last
    answer could miss that request's share."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = server_counters(url)
        counted = now.serving.e2e_latency_count - before.serving.e2e_latency_count
        if counted >= requests or time.monotonic() > deadline:
            if counted < requests:
                logger.warning("vLLM counted %.0f of %d requests at %s", counted, requests, url)
            return now
        time.sleep(0.05)
