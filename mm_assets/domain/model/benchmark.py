"""Benchmarking a draft per category: prompts, rounds and the figures vLLM's counters give.

The target answers every user turn itself (the dataset's assistant turns are dropped),
in the run without speculation, and every method is sent the prompts built from those
answers: a method's figures then differ only by how it decodes, never by what it was
asked. Figures keep the counter sums they are computed from, so categories combine
exactly as one counter difference over all of them would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from mm_assets.domain.model.acceptance import OVERALL, Acceptance, WithAcceptance, combine
from mm_assets.domain.model.intervals import Interval, paired_ratio_interval, ratio_interval

Turn = dict[str, Any]
# Bump when a change makes a benchmark produce other figures from the same inputs (the
# reuse key of recorded figures holds it). 3: figures from per-prompt records; 4: methods
# interleaved, each speedup paired with no speculation sent beside it.
BENCHMARK_VERSION = "4"
Method = tuple[str, int | None]
"""A method at a depth: ("eagle3", 3), ("ngram", 5); ("none", None) speculates nothing."""
NONE: Method = ("none", None)
BASELINES = ("none", "ngram")
"""The methods a draft is compared with; any other method is a draft's family."""
DEFAULT_DEPTH = 3  # n-gram's, when no draft says its own


@dataclass(frozen=True)
class BenchmarkConversation:
    system: list[Turn]
    questions: list[Turn]
    """The user turns, in order: one round each."""

    @property
    def rounds(self) -> int:
        return len(self.questions)


def benchmark_conversation(turns: Sequence[Turn]) -> BenchmarkConversation:
    """A normalized conversation as a benchmark sees it: its system turns (in front) and
    its user turns; assistant and tool turns are dropped (the target answers itself)."""
    system = [t for t in turns if t["role"] == "system"]
    questions = [t for t in turns if t["role"] == "user"]
    if not questions:
        raise ValueError("a benchmark conversation needs at least one user turn")
    return BenchmarkConversation(system, questions)


def round_prompt(conversation: BenchmarkConversation, answers: Sequence[str], k: int) -> list[Turn]:
    """Round k's prompt (0-based): the system turns, then each earlier question with the
    target's answer to it (`answers[:k]`), then question k."""
    if len(answers) < k:
        raise ValueError(f"round {k} needs the answers of the {k} rounds before it")
    turns = list(conversation.system)
    for question, answer in zip(conversation.questions[:k], answers, strict=False):
        turns += [question, {"role": "assistant", "content": answer}]
    return [*turns, conversation.questions[k]]


def capped(
    categories: dict[str, list[list[Turn]]], limit: int | None
) -> dict[str, list[list[Turn]]]:
    """The first `limit` conversations of each category (all with None), in order."""
    return {name: convs[:limit] if limit else list(convs) for name, convs in categories.items()}


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class BenchmarkFigures(WithAcceptance):
    """One method on one category (or all of them: `OVERALL`): vLLM's counter sums, and
    the figures a user reads as properties of them."""

    category: str
    method: str
    prompts: int
    """Conversations."""
    requests: int
    output_tokens: int
    latency_s: float
    """Σ end-to-end latency of the requests (vLLM's histogram sum)."""
    time_per_output_token_sum_s: float
    time_per_output_token_count: int
    acceptance: Acceptance = field(default_factory=Acceptance)
    lossless: int | None = None
    """Requests whose greedy output equals the no-speculation output (None for `none`,
    which is the reference)."""
    compared: int = 0
    """Requests the lossless count is out of."""
    depth: int | None = None
    """Tokens proposed per step (None for `none`)."""

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens ÷ Σ end-to-end latency of the requests."""
        return self.output_tokens / self.latency_s if self.latency_s else 0.0

    @property
    def mean_time_per_output_token_ms(self) -> float:
        count = self.time_per_output_token_count
        return 1000.0 * self.time_per_output_token_sum_s / count if count else 0.0


@dataclass(frozen=True)
class PromptFigures(WithAcceptance):
    """One request of a benchmark (round `round` of conversation `conversation` of a
    category) on one method: what it generated, how long it took, its own acceptance
    counts as vLLM's reply gave them, and whether it equals no speculation's output."""

    category: str
    method: str
    conversation: int
    round: int
    output_tokens: int
    latency_s: float
    """Sent to answered, as the client waited."""
    decode_s: float | None
    """vLLM's first output token to its last (None: the server did not say)."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    lossless: bool | None = None
    depth: int | None = None
    beside: str | None = None
    """No speculation's request sent in turn with this method's (its `label`) on the same
    prompt: the method's speed-up is paired with these, so drift falls on both sides."""

    @property
    def prompt(self) -> tuple[str, int]:
        """The unit intervals resample: a conversation (its rounds share their image and
        their subject, so they are not independent prompts)."""
        return (self.category, self.conversation)


def figures_of(category: str, method: Method, records: Sequence[PromptFigures]) -> BenchmarkFigures:
    """One row from the records of its requests: every count summed."""
    lossless = [r.lossless for r in records]
    decoded = [r for r in records if r.decode_s is not None]
    return BenchmarkFigures(
        category,
        method[0],
        prompts=len({r.prompt for r in records}),
        requests=len(records),
        output_tokens=sum(r.output_tokens for r in records),
        latency_s=sum(r.latency_s for r in records),
        time_per_output_token_sum_s=sum(r.decode_s or 0.0 for r in decoded),
        time_per_output_token_count=sum(max(r.output_tokens - 1, 0) for r in decoded),
        acceptance=combine(r.acceptance for r in records),
        lossless=None if None in lossless or not records else sum(map(bool, lossless)),
        compared=0 if None in lossless else len(records),
        depth=method[1],
    )


@dataclass(frozen=True)
class FigureIntervals:
    """A row's figures with their 95% intervals over its prompts (`intervals`)."""

    acceptance_length: Interval | None
    tokens_per_s: Interval | None
    speedup: Interval | None
    """tokens/s ÷ no speculation's on the same prompts, paired; None for `none`."""


@dataclass(frozen=True)
class _PromptTotals:
    output_tokens: float = 0.0
    latency_s: float = 0.0
    drafts: float = 0.0
    accepted: float = 0.0


def prompt_totals(
    records: Sequence[PromptFigures],
    method: Method,
    category: str = OVERALL,
    beside: str | None = None,
) -> dict[tuple[str, int], _PromptTotals]:
    """Per prompt (conversation) of `category` (every category: `OVERALL`), the sums of
    its rounds on `method` (with `beside`: no speculation's requests sent in turn with
    that method's)."""
    totals: dict[tuple[str, int], _PromptTotals] = {}
    for r in records:
        if (r.method, r.depth) != method or category not in (OVERALL, r.category):
            continue
        if r.beside != beside:
            continue
        t = totals.get(r.prompt, _PromptTotals())
        totals[r.prompt] = _PromptTotals(
            t.output_tokens + r.output_tokens,
            t.latency_s + r.latency_s,
            t.drafts + r.acceptance.drafts,
            t.accepted + r.acceptance.accepted,
        )
    return totals


# A figure as a ratio of a prompt's sums: (numerator, denominator), added to the ratio.
RATIOS = {
    "acceptance_length": ("accepted", "drafts", 1.0),
    "tokens_per_s": ("output_tokens", "latency_s", 0.0),
}


def _columns(totals: Sequence[_PromptTotals], figure: str) -> tuple[list[float], list[float]]:
    num, den, _ = RATIOS[figure]
    return [getattr(t, num) for t in totals], [getattr(t, den) for t in totals]


def intervals(records: Sequence[PromptFigures], method: Method, category: str) -> FigureIntervals:
    """The intervals of one row (method × category) from its prompts' records."""
    mine = prompt_totals(records, method, category)
    if not mine:
        return FigureIntervals(None, None, None)
    rows, strata = list(mine.values()), [category for category, _ in mine]
    acceptance = ratio_interval(*_columns(rows, "acceptance_length"), 1.0, strata)
    speed = ratio_interval(*_columns(rows, "tokens_per_s"), strata=strata)
    ratio = None
    if method != NONE:
        ratio = comparison(records, (method, NONE), category, "tokens_per_s")
    return FigureIntervals(acceptance, speed, ratio)


def comparison(
    records: Sequence[PromptFigures],
    methods: tuple[Method, Method],
    category: str,
    figure: str,
) -> Interval | None:
    """How `methods[0]` compares with `methods[1]` on the prompts both ran: the ratio of
    their `figure` (`acceptance_length` or `tokens_per_s`), with a paired interval.
    Against no speculation, its requests sent in turn with `methods[0]`'s where there
    are any (`PromptFigures.beside`)."""
    a = prompt_totals(records, methods[0], category)
    beside = label(methods[0])
    interleaved = methods[1] == NONE and any(r.beside == beside for r in records)
    b = prompt_totals(records, methods[1], category, beside if interleaved else None)
    shared = [p for p in a if p in b]
    if not shared:
        return None
    return paired_ratio_interval(
        _columns([a[p] for p in shared], figure),
        _columns([b[p] for p in shared], figure),
        offset=RATIOS[figure][2],
        strata=[category for category, _ in shared],
    )


def combined(figures: Sequence[BenchmarkFigures], category: str = OVERALL) -> BenchmarkFigures:
    """Several categories of one method as one row: every count summed, so acceptance is
    weighted by drafts and tokens/s is Σ tokens ÷ Σ latency."""
    methods = {method_of(f) for f in figures}
    if len(methods) != 1:
        raise ValueError(f"combine the rows of one method at a time, not {sorted(methods)}")
    lossless = [f.lossless for f in figures]
    counts = [c.name for c in fields(BenchmarkFigures) if c.type in ("int", "float")]
    method, depth = methods.pop()
    return BenchmarkFigures(
        category,
        method,
        **{name: sum(getattr(f, name) for f in figures) for name in counts},
        acceptance=combine(f.acceptance for f in figures),
        lossless=None if None in lossless else sum(x for x in lossless if x is not None),
        depth=depth,
    )


@dataclass(frozen=True)
class Generation:
    """A greedy generation's token ids, and whether `max_tokens` stopped it (rather than
    the model ending its reply)."""

    token_ids: Sequence[int]
    cut: bool

    @classmethod
    def limited(cls, token_ids: Sequence[int], max_tokens: int) -> Generation:
        return cls(token_ids, len(token_ids) >= max_tokens)


def same_generation(a: Generation, b: Generation) -> bool:
    """What "lossless" means everywhere: the same token ids, except that a generation cut
    by `max_tokens` only has to agree with the other up to its cut (more tokens would have
    continued it); a reply that ended early never matches a longer one."""
    ends = [len(g.token_ids) for g in (a, b) if g.cut]
    n = min(ends) if ends else None
    return list(a.token_ids[:n]) == list(b.token_ids[:n])


def lossless_count(pairs: Iterable[tuple[Generation, Generation]]) -> int:
    """Pairs that are the same generation (`same_generation`)."""
    return sum(same_generation(a, b) for a, b in pairs)


def with_overall(rows: Sequence[BenchmarkFigures]) -> list[BenchmarkFigures]:
    """The per-category rows followed by one `OVERALL` row per method (`combined`)."""
    per_category = [r for r in rows if r.category != OVERALL]
    methods = list(dict.fromkeys(method_of(r) for r in per_category))
    overall = [combined([r for r in per_category if method_of(r) == m]) for m in methods]
    return per_category + overall


def method_of(row: BenchmarkFigures | PromptFigures) -> Method:
    return (row.method, row.depth)


@dataclass(frozen=True)
class MethodRun:
    """One method's run: figures and answers (per conversation, per round) per category,
    and the figures of one counter difference over all categories."""

    method: str
    depth: int | None = None
    figures: list[BenchmarkFigures] = field(default_factory=list)
    answers: dict[str, list[list[Answer]]] = field(default_factory=dict)
    records: list[PromptFigures] = field(default_factory=list)
    """One per request, every figure is summed from (`figures_of`); then no speculation's
    requests sent in turn with them (`PromptFigures.beside`), if any."""
    whole_run: BenchmarkFigures | None = None
    """vLLM's counters over the whole run: what the records must add up to."""
    not_run: str | None = None  # vLLM's refusal to start it
    reused: bool = False


def label(method: Method) -> str:
    """How a method at a depth is named in a report's runs and its servers' logs."""
    return method[0] if method[1] is None else f"{method[0]}@{method[1]}"


@dataclass(frozen=True)
class BenchmarkReport:
    rows: list[BenchmarkFigures]  # per category per method, then `OVERALL` per method
    runs: dict[str, MethodRun]
    """By `label`: none, then ngram@d and eagle3@d for each depth d."""
    prompts: dict[str, list[list[list[Turn]]]]
    """What every method was sent, per category, conversation and round (from `none`)."""
    depth: int = DEFAULT_DEPTH
    """The depth shown first: the draft's own when measured, else the first one."""

    @property
    def shown(self) -> list[BenchmarkFigures]:
        """The rows at `depth`, and no speculation's."""
        return [f for f in self.rows if f.depth in (None, self.depth)]

    @property
    def draft_method(self) -> str | None:
        """The draft's family as vLLM names its method (None: no draft benchmarked)."""
        return next((r.method for r in self.runs.values() if r.method not in BASELINES), None)

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

    @cached_property
    def row_intervals(self) -> dict[tuple[str, Method], FigureIntervals]:
        """Each row's intervals by (category, method), bootstrapped once for every
        table, plot and line that shows them."""
        records = self.records
        return {
            (f.category, method_of(f)): intervals(records, method_of(f), f.category)
            for f in self.rows
        }

    def speedup(self, row: BenchmarkFigures) -> float | None:
        """The row's tokens/s ÷ no speculation's on the same prompts (paired with the
        requests sent in turn with it); 1.0 for `none` itself."""
        if method_of(row) == NONE:
            return 1.0
        found = self.row_intervals[(row.category, method_of(row))].speedup
        return found.value if found else None
