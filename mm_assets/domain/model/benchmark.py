"""Benchmarking a draft per category: prompts, rounds and the figures vLLM's counters give.

The target answers every user turn itself (the dataset's assistant turns are dropped),
in the run without speculation, and every method is sent the prompts built from those
answers: a method's figures then differ only by how it decodes, never by what it was
asked. Figures keep the counter sums they are computed from, so categories combine
exactly as one counter difference over all of them would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mm_assets.common.request_settings import MAX_CONCURRENCY
from mm_assets.domain.model.acceptance import OVERALL, Acceptance, WithAcceptance, combine

Turn = dict[str, Any]
# Bump when a change makes a benchmark produce other figures from the same inputs (the
# reuse key of recorded figures holds it).
BENCHMARK_VERSION = "2"


class BenchmarkSettings(BaseModel):
    """How a benchmark is run, declared once (the asset's config is made from it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(default=128, ge=1, description="Tokens generated per request.")
    concurrency: int = Field(
        default=1,
        ge=1,
        le=MAX_CONCURRENCY,
        description="Requests in flight. 1: the latency regime speculative decoding is for; "
        "at most 1024, as for the other stages' requests.",
    )
    ngram_speculative_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Tokens vLLM's n-gram method proposes per step; None: the draft's, or 3.",
    )
    prompt_lookup_min: int = Field(default=2, ge=1, description="n-gram: shortest match.")
    prompt_lookup_max: int = Field(default=4, ge=1, description="n-gram: longest match.")
    max_prompts_per_category: int | None = Field(
        default=None, ge=1, description="Conversations measured per category; None: all."
    )
    warmup_max_tokens: int = Field(
        default=8, ge=1, description="Tokens of the warm-up request sent to each server."
    )
    start_servers_together: bool | None = Field(
        default=None,
        description="Start the methods' servers at once (their start-ups overlap), then "
        "measure each in turn while the others idle; else one at a time. None: together "
        "on CPU, one at a time on a GPU (each server would claim most of its memory).",
    )


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

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens ÷ Σ end-to-end latency of the requests."""
        return self.output_tokens / self.latency_s if self.latency_s else 0.0

    @property
    def mean_time_per_output_token_ms(self) -> float:
        count = self.time_per_output_token_count
        return 1000.0 * self.time_per_output_token_sum_s / count if count else 0.0


def combined(figures: Sequence[BenchmarkFigures], category: str = OVERALL) -> BenchmarkFigures:
    """Several categories of one method as one row: every count summed, so acceptance is
    weighted by drafts and tokens/s is Σ tokens ÷ Σ latency."""
    methods = {f.method for f in figures}
    if len(methods) != 1:
        raise ValueError(f"combine the rows of one method at a time, not {sorted(methods)}")
    lossless = [f.lossless for f in figures]
    counts = [c.name for c in fields(BenchmarkFigures) if c.type in ("int", "float")]
    return BenchmarkFigures(
        category,
        methods.pop(),
        **{name: sum(getattr(f, name) for f in figures) for name in counts},
        acceptance=combine(f.acceptance for f in figures),
        lossless=None if None in lossless else sum(x for x in lossless if x is not None),
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


def with_lossless(
    figures: BenchmarkFigures,
    outputs: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    max_tokens: int,
) -> BenchmarkFigures:
    pairs = [
        (Generation.limited(a, max_tokens), Generation.limited(b, max_tokens))
        for a, b in zip(outputs, reference, strict=True)
    ]
    return replace(figures, lossless=lossless_count(pairs), compared=len(reference))


def speedup(figures: BenchmarkFigures, rows: Sequence[BenchmarkFigures]) -> float | None:
    """tokens/s ÷ the `none` method's tokens/s on the same category; None without one."""
    base = next((r for r in rows if r.category == figures.category and r.method == "none"), None)
    if base is None or not base.tokens_per_s:
        return None
    return figures.tokens_per_s / base.tokens_per_s


def with_overall(rows: Sequence[BenchmarkFigures]) -> list[BenchmarkFigures]:
    """The per-category rows followed by one `OVERALL` row per method (`combined`)."""
    methods = list(dict.fromkeys(r.method for r in rows if r.category != OVERALL))
    per_category = [r for r in rows if r.category != OVERALL]
    overall = [combined([r for r in per_category if r.method == m]) for m in methods]
    return per_category + overall
