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

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
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
    OVERALL,
    Answer,
    BenchmarkConversation,
    BenchmarkFigures,
    BenchmarkSettings,
    Generation,
    PromptFigures,
    Turn,
    benchmark_conversation,
    capped,
    figures_of,
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
DEFAULT_NGRAM_TOKENS = 3


@dataclass(frozen=True)
class MethodRun:
    """One method's run: figures and answers (per conversation, per round) per category,
    and the figures of one counter difference over all categories."""

    method: str
    figures: list[BenchmarkFigures] = field(default_factory=list)
    answers: dict[str, list[list[Answer]]] = field(default_factory=dict)
    records: list[PromptFigures] = field(default_factory=list)
    """One per request, every figure is summed from (`figures_of`)."""
    whole_run: BenchmarkFigures | None = None
    """vLLM's counters over the whole run: what the records must add up to."""
    not_run: str | None = None  # vLLM's refusal to start it
    reused: bool = False


@dataclass(frozen=True)
class BenchmarkReport:
    rows: list[BenchmarkFigures]  # per category per method, then `OVERALL` per method
    runs: dict[str, MethodRun]
    prompts: dict[str, list[list[list[Turn]]]]
    """What every method was sent, per category, conversation and round (from `none`)."""

    @property
    def not_run(self) -> dict[str, str]:
        return {m: r.not_run for m, r in self.runs.items() if r.not_run is not None}

    @property
    def reused(self) -> dict[str, bool]:
        return {m: r.reused for m, r in self.runs.items()}

    @property
    def records(self) -> list[PromptFigures]:
        """Every request of every method, the prompt-level figures intervals come from."""
        return [r for run in self.runs.values() for r in run.records]


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


def _records(category: str, method: str, replies: list[list[ChatReply]]) -> list[PromptFigures]:
    """One record per request, from what the client timed and vLLM's reply reported."""
    return [
        PromptFigures(
            category,
            method,
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
        )
        for i, conv in enumerate(replies)
        for k, reply in enumerate(conv)
    ]


def run_method(
    method: str,
    servers: MethodServers,
    categories: dict[str, list[BenchmarkConversation]],
    reference: dict[str, list[list[Answer]]] | None,
    settings: BenchmarkSettings,
) -> MethodRun:
    """One method on its server: a warm-up request, then each category between two
    scrapes of the counters (see the module's docstring)."""
    try:
        url = servers.url(method)
    except ServerStartupError as exc:
        if method == "none":
            raise
        logger.warning(f"benchmark: vLLM did not start the {method} method: {exc}")
        return MethodRun(method, not_run=str(exc))
    try:
        server = servers.servers[method]
        with death_explained(server, f"benchmarking {method}"):
            zero = server_counters(url)
            generate_greedy_replies(
                url, server.access, [WARMUP_PROMPT], settings.warmup_max_tokens, 1
            )
            start = counters_after(url, zero, 1)
            records, answers = [], {}
            for name, conversations in categories.items():
                mine = reference and reference[name]
                replies = _category_replies(server, conversations, mine, settings)
                records += _records(name, method, replies)
                answers[name] = [[Answer(r.text, r.token_ids) for r in conv] for conv in replies]
            whole = counters_after(url, start, len(records)).minus(start)
    finally:
        servers.done(method)
    figures = [
        figures_of(name, method, [r for r in records if r.category == name]) for name in categories
    ]
    total = _figures(OVERALL, method, sum(f.prompts for f in figures), len(records), whole)
    return MethodRun(method, figures, answers, records, total)


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
    figures = [
        figures_of(f.category, f.method, [r for r in records if r.category == f.category])
        for f in run.figures
    ]
    total = figures_of(OVERALL, run.method, records)
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
    ngram_tokens = settings.ngram_speculative_tokens or (
        draft.speculative_tokens if draft else DEFAULT_NGRAM_TOKENS
    )
    fingerprint = target_fingerprint(serving.target_dir)
    options = serving.engine.options.model_dump()
    base_key = json_sha256(
        [BENCHMARK_VERSION, fingerprint, categories, settings.model_dump(), options, ngram_tokens]
    )
    keys = {"none": base_key, "ngram": base_key}
    lookup = (settings.prompt_lookup_min, settings.prompt_lookup_max)
    serve_args = {"none": [], "ngram": ngram_args(ngram_tokens, *lookup)}
    if draft is not None:
        keys["eagle3"] = json_sha256([base_key, draft.weights_sha256, draft.speculative_tokens])
        serve_args["eagle3"] = draft.serve_args()
    names = {"none": "none", "ngram": "ngram", "eagle3": "draft"}
    records = {m: cache_dir / f"benchmark_{names[m]}_{k[:20]}.json" for m, k in keys.items()}
    found = {m: (load_record(records[m], k) if reuse else None) for m, k in keys.items()}
    if found["none"] is None:  # ngram was checked against the recorded `none`
        found["ngram"] = None
    recorded = {m: _from_record(record) for m, record in found.items() if record}
    runs: dict[str, MethodRun] = {}
    with MethodServers(serving, settings.start_servers_together) as servers:
        servers.start({m: args for m, args in serve_args.items() if m not in recorded})
        for method in keys:  # `none` first: the reference of the others
            if method in recorded:
                runs[method] = recorded[method]
                continue
            reference = runs.get("none")
            answers = reference.answers if reference else None
            run = run_method(method, servers, conversations, answers, settings)
            runs[method] = _checked(run, reference, settings.max_tokens) if reference else run
            if run.not_run is None:  # a method vLLM did not start is tried again next time
                save_record(records[method], keys[method], asdict(runs[method]))
    none = runs["none"]
    rows = with_overall([f for r in runs.values() for f in r.figures])
    prompts = {
        name: all_prompts(convs, none.answers[name]) for name, convs in conversations.items()
    }
    return BenchmarkReport(rows, runs, prompts)


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
