"""A draft benchmarked per category in vLLM, beside no speculation and vLLM's n-gram method.

Each method runs on a server of its own (`services/method_servers.py`). On CPU the
servers of a depth are up together and the methods are sent each batch of requests in
turn (`none`, n-gram, the draft; the order rotating), so a drift of the machine falls on
all of them and each speed-up pairs with the no-speculation requests sent beside it
(`PromptFigures.beside`); `none` stays up from one depth to the next. On a GPU, which
holds one server, each method runs alone, `none` first. `none`'s answers are the
target's: every method's later rounds quote them, and losslessness is checked against
its token ids. A warm-up request goes first (compilation is not the draft's cost). Every
request is a record with its own counts (vLLM's reply gives them) and the rows are their
sums; one pair of `/metrics` scrapes per server spans every category, which the records
must add up to (`whole_run`).

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
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mm_assets.clients.serve_args import ngram_args
from mm_assets.clients.vllm_generation import ChatReply, generate_greedy_replies
from mm_assets.clients.vllm_metrics import ServerCounters, counters_after, server_counters
from mm_assets.clients.vllm_server import ServerStartupError, death_explained
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


def _checked(run: MethodRun, reference: MethodRun, max_tokens: int) -> MethodRun:
    """The run's records marked lossless or not against the reference's token ids, and
    its figures summed again from them."""
    if run.not_run is not None:
        return run

    def same(r: PromptFigures) -> bool:
        ours, ref = (x.answers[r.category][r.conversation][r.round] for x in (run, reference))
        limited = (Generation.limited(a.token_ids, max_tokens) for a in (ours, ref))
        return same_generation(*limited)

    beside = [r for r in run.records if r.beside is not None]
    records = [replace(r, lossless=same(r)) for r in run.records if r.beside is None]
    method = (run.method, run.depth)
    figures = [
        figures_of(f.category, method, [r for r in records if r.category == f.category])
        for f in run.figures
    ]
    total = figures_of(OVERALL, method, records)
    whole = run.whole_run and replace(
        run.whole_run, lossless=total.lossless, compared=total.compared
    )
    return replace(run, figures=figures, records=records + beside, whole_run=whole)


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


def _groups(
    depths: list[int],
    plan: dict[Method, tuple[str, list[str], Path]],
    recorded: dict[Method, MethodRun],
    together: bool,
) -> list[list[Method]]:
    """The methods measured together, in order. Servers up together (CPU): a depth at a
    time, `none` with each depth's unrecorded methods (at most three servers up), so
    every speed-up pairs with no speculation sent in turn with it. One at a time (a GPU
    holds one server): each method alone, `none` first."""
    todo = [m for m in plan if m != NONE and m not in recorded]
    if not together:
        return [[m] for m in ([] if NONE in recorded else [NONE]) + todo]
    if not todo:
        return [] if NONE in recorded else [[NONE]]
    groups = [[NONE, *(m for m in todo if m[1] == d)] for d in depths]
    return [g for g in groups if len(g) > 1]


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
    runs = {label(m): run for m, run in recorded.items()}
    with MethodServers(serving, settings.start_servers_together) as servers:
        for group in _groups(depths, plan, recorded, servers.together):
            servers.start({label(m): plan[m][1] for m in group if label(m) not in servers.servers})
            reference = runs.get("none")
            answers = reference.answers if reference else None
            for method, run in run_methods(
                group, servers, conversations, answers, settings
            ).items():
                if method == NONE and "none" in runs:
                    continue  # served again as the others' pair only: its first run stands
                reference = runs.get("none")
                run = _checked(run, reference, settings.max_tokens) if reference else run
                runs[label(method)] = run
                if run.not_run is None:  # a method vLLM did not start is tried again
                    key, _, path = plan[method]
                    save_record(path, key, asdict(run))
            for method in group:  # `none` stays up for the next depth's pairs
                if method != NONE or not servers.together:
                    servers.done(label(method))
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
