"""A benchmark's methods sent their requests: together and in turn (`run_methods`).

Each batch of requests (`concurrency` of them) goes to every method before the next
batch goes to any, the order rotating from batch to batch, so a drift of the machine
falls on all methods alike; round k of every conversation goes before round k+1, whose
prompts quote the answers of round k. Every request becomes a record with its own counts
(vLLM's reply gives them), and each server's `/metrics` counters are read around its
requests, which the records must add up to (`MethodRun.whole_run`).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import replace

from mm_assets.clients.vllm_generation import ChatReply, generate_greedy_replies
from mm_assets.clients.vllm_metrics import ServerCounters, counters_after, server_counters
from mm_assets.clients.vllm_server import ServerStartupError, death_explained
from mm_assets.domain.model.acceptance import OVERALL, Acceptance
from mm_assets.domain.model.benchmark import (
    NONE,
    Answer,
    BenchmarkConversation,
    BenchmarkFigures,
    Method,
    MethodRun,
    PromptFigures,
    figures_of,
    label,
    round_prompt,
)
from mm_assets.domain.model.settings import BenchmarkSettings
from mm_assets.domain.prep.conversations import to_vllm_messages
from mm_assets.services.method_servers import MethodServers

logger = logging.getLogger(__name__)
WARMUP_PROMPT = [{"role": "user", "content": "Hello."}]


def _figures(
    category: str, method: str, prompts: int, requests: int, counters: ServerCounters
) -> BenchmarkFigures:
    spec, serving = counters.spec_decode, counters.serving
    return BenchmarkFigures(
        category,
        method,
        prompts,
        requests,
        output_tokens=round(serving.generation_tokens),
        latency_s=serving.e2e_latency_sum_s,
        time_per_output_token_sum_s=serving.time_per_output_token_sum_s,
        time_per_output_token_count=round(serving.time_per_output_token_count),
        acceptance=Acceptance.from_counts(spec.drafts, spec.accepted, spec.accepted_per_position),
    )


def _batches(
    conversations: dict[str, list[BenchmarkConversation]], k: int, size: int
) -> list[list[tuple[str, int]]]:
    """Round k's requests, (category, conversation), in batches of `size` (requests in
    flight): every method is sent one batch before any is sent the next."""
    asked = [(c, i) for c, convs in conversations.items() for i, conv in enumerate(convs)]
    asked = [(c, i) for c, i in asked if conversations[c][i].rounds > k]
    return [asked[j : j + size] for j in range(0, len(asked), size)]


def _turns(methods: list[Method], at: int) -> list[Method]:
    """The methods in the order they are sent batch `at`: rotated each batch, so none of
    them is always first after a pause (or always last)."""
    shift = at % len(methods)
    return methods[shift:] + methods[:shift]


def _interleaved(
    methods: list[Method],
    servers: MethodServers,
    conversations: dict[str, list[BenchmarkConversation]],
    reference: dict[str, list[list[Answer]]] | None,
    settings: BenchmarkSettings,
) -> dict[Method, dict[str, list[list[ChatReply]]]]:
    """Every method's replies, sent in turn batch by batch (`_batches`, `_turns`): a
    drift of the machine falls on all of them alike. Round k of every conversation goes
    before round k+1: a later round quotes the reference answers, or without one
    (`none` measured now) those `none` just generated."""
    replies = {m: {c: [[] for _ in convs] for c, convs in conversations.items()} for m in methods}
    rounds = max((conv.rounds for convs in conversations.values() for conv in convs), default=0)
    at = 0
    for k in range(rounds):
        for batch in _batches(conversations, k, settings.concurrency):
            prompts = []
            for category, i in batch:
                quoted = reference[category][i] if reference else replies[NONE][category][i]
                asked = round_prompt(conversations[category][i], [a.text for a in quoted], k)
                prompts.append(to_vllm_messages(asked))
            for method in _turns(methods, at):
                server = servers.servers[label(method)]
                answered = generate_greedy_replies(
                    server.base_url, server.access, prompts, settings.max_tokens, len(prompts)
                )
                for (category, i), reply in zip(batch, answered, strict=True):
                    replies[method][category][i].append(reply)
            at += 1
    return replies


def _records(
    category: str, method: Method, replies: list[list[ChatReply]], beside: str | None = None
) -> list[PromptFigures]:
    """One record per request, from what the client timed and vLLM's reply reported."""
    return [
        PromptFigures(
            category,
            method[0],
            conversation=i,
            round=k,
            output_tokens=len(reply.token_ids),
            latency_s=reply.metrics.seconds,
            decode_s=reply.metrics.decode_s,
            acceptance=Acceptance(
                reply.metrics.verifications,
                reply.metrics.accepted,
                reply.metrics.accepted_per_position or (),
            ),
            depth=method[1],
            beside=beside,
        )
        for i, conv in enumerate(replies)
        for k, reply in enumerate(conv)
    ]


def run_methods(
    methods: list[Method],
    servers: MethodServers,
    conversations: dict[str, list[BenchmarkConversation]],
    reference: dict[str, list[list[Answer]]] | None,
    settings: BenchmarkSettings,
) -> dict[Method, MethodRun]:
    """Methods measured together (`_interleaved`), each on its server: a warm-up request
    each, then every category's requests, inside one pair of counter scrapes per server
    (see the module's docstring). With `none` among them, each other method's run also
    holds no speculation's requests sent in turn with its own (`PromptFigures.beside`)."""
    runs: dict[Method, MethodRun] = {}
    live: list[Method] = []
    for method in methods:
        try:
            servers.url(label(method))
            live.append(method)
        except ServerStartupError as exc:
            if method == NONE:
                raise
            logger.warning(f"benchmark: vLLM did not start the {label(method)} method: {exc}")
            runs[method] = MethodRun(*method, not_run=str(exc))
    with ExitStack() as stack:
        start = {}
        for method in live:
            server = servers.servers[label(method)]
            stack.enter_context(death_explained(server, f"benchmarking {label(method)}"))
            zero = server_counters(server.base_url)
            generate_greedy_replies(
                server.base_url, server.access, [WARMUP_PROMPT], settings.warmup_max_tokens, 1
            )
            start[method] = counters_after(server.base_url, zero, 1)
        replies = _interleaved(live, servers, conversations, reference, settings)
        for method in live:
            url = servers.servers[label(method)].base_url
            records = [r for c, rs in replies[method].items() for r in _records(c, method, rs)]
            whole = counters_after(url, start[method], len(records)).minus(start[method])
            runs[method] = _run(method, conversations, replies[method], records, whole)
    if NONE in live:  # its requests, as the pair of each other method's speed
        for method in live:
            if method != NONE:
                beside = [
                    r
                    for c, rs in replies[NONE].items()
                    for r in _records(c, NONE, rs, label(method))
                ]
                runs[method] = replace(runs[method], records=runs[method].records + beside)
    return {m: runs[m] for m in methods}


def _run(
    method: Method,
    conversations: dict[str, list[BenchmarkConversation]],
    replies: dict[str, list[list[ChatReply]]],
    records: list[PromptFigures],
    whole: ServerCounters,
) -> MethodRun:
    figures = [
        figures_of(c, method, [r for r in records if r.category == c]) for c in conversations
    ]
    prompts = sum(f.prompts for f in figures)
    total = replace(_figures(OVERALL, method[0], prompts, len(records), whole), depth=method[1])
    answers = {
        c: [[Answer(r.text, r.token_ids) for r in conv] for conv in rs] for c, rs in replies.items()
    }
    return MethodRun(*method, figures, answers, records, total)
