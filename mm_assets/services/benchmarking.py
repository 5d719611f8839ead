"""A draft benchmarked per category in vLLM, beside no speculation and vLLM's n-gram method.

Each method runs on a server of its own (`services/method_servers.py`), one after the
other: `none` first, since its answers are the target's (every method's later rounds
quote them, and losslessness is checked against its token ids), then `ngram`, then
`eagle3`. A warm-up request goes first (compilation is not the draft's cost). Every
request is a record with its own counts (vLLM's reply gives them) and the rows are their
sums; one pair of `/metrics` scrapes spans every category, which the records must add up
to (`whole_run`).

Servers cost minutes, so figures are recorded under the cache directory: `none` and
`ngram` keyed by the target's content, the conversations, the settings and the engine
options (a second draft on the same benchmark starts no baseline server), the draft's
keyed by its weights too. A method vLLM refuses to start is reported as not run, with
vLLM's reason; `none` failing fails the benchmark (nothing to compare with).

A benchmark's prompts are its partition's normalized conversations (`role: benchmark`
entries are prepared like any dataset), by category (`load_benchmark`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mm_assets.clients.serve_args import ngram_args
from mm_assets.clients.vllm_generation import ChatReply, generate_greedy_replies
from mm_assets.clients.vllm_metrics import ServerCounters, counters_after, server_counters
from mm_assets.clients.vllm_server import ManagedVllmServer, ServerStartupError, death_explained
from mm_assets.common.hashing import json_sha256
from mm_assets.domain.model.acceptance import Acceptance
from mm_assets.domain.model.benchmark import (
    BENCHMARK_VERSION,
    DEFAULT_DEPTH,
    NONE,
    OVERALL,
    Answer,
    BenchmarkConversation,
    BenchmarkFigures,
    BenchmarkReport,
    BenchmarkSettings,
    Generation,
    Method,
    MethodRun,
    PromptFigures,
    Turn,
    benchmark_conversation,
    capped,
    figures_of,
    label,
    round_prompt,
    same_generation,
    with_overall,
)
from mm_assets.domain.prep.conversations import to_vllm_messages
from mm_assets.registry.specs import DEFAULT_CATEGORY
from mm_assets.services.engine import DraftUnderTest, Serving
from mm_assets.services.method_servers import MethodServers
from mm_assets.services.target import target_fingerprint
from mm_assets.storage import TableStore
from mm_assets.storage.records import load_record, save_record

logger = logging.getLogger(__name__)
WARMUP_PROMPT = [{"role": "user", "content": "Hello."}]


def all_prompts(
    conversations: list[BenchmarkConversation], answers: list[list[Answer]]
) -> list[list[list[Turn]]]:
    """Every round's prompt of each conversation, from the reference answers."""
    return [
        [round_prompt(conv, [a.text for a in done], k) for k in range(conv.rounds)]
        for conv, done in zip(conversations, answers, strict=True)
    ]


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


def _category_replies(
    server: ManagedVllmServer,
    conversations: list[BenchmarkConversation],
    reference: list[list[Answer]] | None,
    settings: BenchmarkSettings,
) -> list[list[ChatReply]]:
    """A category's conversations, round k of each before round k+1: a later round
    quotes the reference answers, or without one (`none` itself) those just generated."""
    replies: list[list[ChatReply]] = [[] for _ in conversations]
    for k in range(max((c.rounds for c in conversations), default=0)):
        asked = [i for i, c in enumerate(conversations) if c.rounds > k]
        quoted = reference or [[Answer(r.text, r.token_ids) for r in conv] for conv in replies]
        prompts = [
            to_vllm_messages(round_prompt(conversations[i], [a.text for a in quoted[i]], k))
            for i in asked
        ]
        answered = generate_greedy_replies(
            server.base_url, server.access, prompts, settings.max_tokens, settings.concurrency
        )
        for i, reply in zip(asked, answered, strict=True):
            replies[i].append(reply)
    return replies


def _records(category: str, method: Method, replies: list[list[ChatReply]]) -> list[PromptFigures]:
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
        )
        for i, conv in enumerate(replies)
        for k, reply in enumerate(conv)
    ]


def run_method(
    method: Method,
    servers: MethodServers,
    categories: dict[str, list[BenchmarkConversation]],
    reference: dict[str, list[list[Answer]]] | None,
    settings: BenchmarkSettings,
) -> MethodRun:
    """One method on its server: a warm-up request, then every category's requests,
    each a record, inside one pair of counter scrapes (see the module's docstring)."""
    name = label(method)
    try:
        url = servers.url(name)
    except ServerStartupError as exc:
        if method == NONE:
            raise
        logger.warning(f"benchmark: vLLM did not start the {name} method: {exc}")
        return MethodRun(*method, not_run=str(exc))
    try:
        server = servers.servers[name]
        with death_explained(server, f"benchmarking {name}"):
            zero = server_counters(url)
            generate_greedy_replies(
                url, server.access, [WARMUP_PROMPT], settings.warmup_max_tokens, 1
            )
            start = counters_after(url, zero, 1)
            records, answers = [], {}
            for category, conversations in categories.items():
                mine = reference and reference[category]
                replies = _category_replies(server, conversations, mine, settings)
                records += _records(category, method, replies)
                answers[category] = [[Answer(r.text, r.token_ids) for r in c] for c in replies]
            whole = counters_after(url, start, len(records)).minus(start)
    finally:
        servers.done(name)
    figures = [figures_of(c, method, [r for r in records if r.category == c]) for c in categories]
    prompts = sum(f.prompts for f in figures)
    total = replace(_figures(OVERALL, method[0], prompts, len(records), whole), depth=method[1])
    return MethodRun(*method, figures, answers, records, total)


def _checked(run: MethodRun, reference: MethodRun, max_tokens: int) -> MethodRun:
    """The run's records marked lossless or not against the reference's token ids, and
    its figures summed again from them."""
    if run.not_run is not None:
        return run

    def same(r: PromptFigures) -> bool:
        ours, ref = (x.answers[r.category][r.conversation][r.round] for x in (run, reference))
        limited = (Generation.limited(a.token_ids, max_tokens) for a in (ours, ref))
        return same_generation(*limited)

    records = [replace(r, lossless=same(r)) for r in run.records]
    method = (run.method, run.depth)
    figures = [
        figures_of(f.category, method, [r for r in records if r.category == f.category])
        for f in run.figures
    ]
    total = figures_of(OVERALL, method, records)
    whole = run.whole_run and replace(
        run.whole_run, lossless=total.lossless, compared=total.compared
    )
    return replace(run, figures=figures, records=records, whole_run=whole)


def _figures_from_record(fields: dict[str, Any]) -> BenchmarkFigures:
    acceptance = Acceptance.from_record(fields["acceptance"])
    return BenchmarkFigures(**{**fields, "acceptance": acceptance})


def _from_record(fields: dict[str, Any]) -> MethodRun:
    whole = fields["whole_run"]
    return MethodRun(
        fields["method"],
        fields["depth"],
        [_figures_from_record(f) for f in fields["figures"]],
        {k: [[Answer(**a) for a in conv] for conv in v] for k, v in fields["answers"].items()},
        [
            PromptFigures(**{**r, "acceptance": Acceptance.from_record(r["acceptance"])})
            for r in fields["records"]
        ],
        _figures_from_record(whole) if whole else None,
        fields["not_run"],
        reused=True,
    )


def _plan(
    base_key: str,
    depths: list[int],
    draft: DraftUnderTest | None,
    settings: BenchmarkSettings,
    cache_dir: Path,
) -> dict[Method, tuple[str, list[str], Path]]:
    """Each method at each depth: its record's key, its serve arguments, its record. The
    `none` and n-gram records are keyed by the target, prompts and settings only, so a
    second draft on the same benchmark starts no baseline server."""
    lookup = (settings.prompt_lookup_min, settings.prompt_lookup_max)
    keys: dict[Method, tuple[str, list[str], str]] = {NONE: (base_key, [], "none")}
    for depth in depths:
        ngram = ngram_args(depth, *lookup)
        keys[("ngram", depth)] = (json_sha256([base_key, depth]), ngram, f"ngram{depth}")
        if draft is not None:
            key = json_sha256([base_key, draft.weights_sha256, depth])
            served = dataclasses.replace(draft, speculative_tokens=depth).serve_args()
            keys[("eagle3", depth)] = (key, served, f"draft{depth}")
    return {
        m: (key, args, cache_dir / f"benchmark_{name}_{key[:20]}.json")
        for m, (key, args, name) in keys.items()
    }


def benchmark(
    serving: Serving,
    categories: dict[str, list[list[Turn]]],
    draft: DraftUnderTest | None,
    settings: BenchmarkSettings,
    cache_dir: Path,
    reuse: bool = True,
) -> BenchmarkReport:
    """Per category, the figures of `none`, `ngram` and (with a draft) `eagle3`, plus an
    `OVERALL` row per method (see the module's docstring)."""
    if not serving.engine.managed:
        raise ValueError(
            "benchmarking starts a server per method (none, ngram, eagle3) with its own "
            "--speculative-config; use a managed vllm resource (no base_urls) for it"
        )
    categories = capped(categories, settings.max_prompts_per_category)
    conversations = {
        name: [benchmark_conversation(turns) for turns in convs]
        for name, convs in categories.items()
    }
    depths = settings.speculative_tokens or [draft.speculative_tokens if draft else DEFAULT_DEPTH]
    fingerprint = target_fingerprint(serving.target_dir)
    options = serving.engine.options.model_dump()
    measured = settings.model_dump(exclude={"speculative_tokens"})
    base_key = json_sha256([BENCHMARK_VERSION, fingerprint, categories, measured, options])
    plan = _plan(base_key, depths, draft, settings, cache_dir)
    found = {m: (load_record(path, key) if reuse else None) for m, (key, _, path) in plan.items()}
    if found[NONE] is None:  # the others were checked against the recorded `none`
        found = dict.fromkeys(found)
    recorded = {m: _from_record(record) for m, record in found.items() if record}
    runs: dict[str, MethodRun] = {}
    # a depth at a time (at most three servers up at once); `none` first, with the first
    groups = [[m for m in plan if m[1] == d] for d in depths]
    groups[0].insert(0, NONE)
    for group in groups:
        with MethodServers(serving, settings.start_servers_together) as servers:
            servers.start({label(m): plan[m][1] for m in group if m not in recorded})
            for method in group:  # `none` first: the reference of the others
                if method in recorded:
                    runs[label(method)] = recorded[method]
                    continue
                reference = runs.get("none")
                answers = reference.answers if reference else None
                run = run_method(method, servers, conversations, answers, settings)
                run = _checked(run, reference, settings.max_tokens) if reference else run
                runs[label(method)] = run
                if run.not_run is None:  # a method vLLM did not start is tried again
                    key, _, path = plan[method]
                    save_record(path, key, asdict(run))
    none = runs["none"]
    rows = with_overall([f for r in runs.values() for f in r.figures])
    prompts = {
        name: all_prompts(convs, none.answers[name]) for name, convs in conversations.items()
    }
    own = draft.speculative_tokens if draft and draft.speculative_tokens in depths else None
    return BenchmarkReport(rows, runs, prompts, own or depths[0])


@dataclass(frozen=True)
class BenchmarkSet:
    """One benchmark's conversations, by category (in the order categories first appear)."""

    name: str
    categories: dict[str, list[list[Turn]]]
    images: bool

    @property
    def conversations(self) -> int:
        return sum(len(c) for c in self.categories.values())


def load_benchmark(
    tables: TableStore, benchmark: str, per_category: int | None = None
) -> BenchmarkSet:
    """The benchmark partition's conversations by category, the first `per_category` of
    each (all when None). Fails with what to run when the benchmark is not prepared."""
    if not tables.exists("normalized_conversations", benchmark):
        raise FileNotFoundError(
            f"benchmark {benchmark!r} is not prepared: materialize its partition first "
            f"(`dagster asset materialize -m mm_assets.definitions --select "
            f"'+normalized_conversations' --partition {benchmark}`, or the prepare job)"
        )
    categories: dict[str, list[list[Turn]]] = {}
    images = False
    columns = ["turns", "category", "multimodal"]
    for row in tables.iter_rows("normalized_conversations", benchmark, columns):
        found = categories.setdefault(category_name(row["category"]), [])
        if per_category is None or len(found) < per_category:
            found.append(json.loads(row["turns"]))
            images = images or bool(row["multimodal"])
    return BenchmarkSet(benchmark, categories, images)


def category_name(stored: str | None) -> str:
    """The category a benchmark row is reported under: `overall` names the row that sums
    every category, so a category of that name is reported as `overall (category)`."""
    name = stored or DEFAULT_CATEGORY
    return f"{OVERALL} (category)" if name == OVERALL else name


def results_key(draft_sha256: str | None, benchmark: str, settings: Mapping[str, Any]) -> str:
    """What makes two measurements the same one: reruns of it replace its rows."""
    return json_sha256([draft_sha256, benchmark, dict(settings)])[:16]
