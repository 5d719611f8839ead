"""Acceptance estimated offline the way vLLM counts it: by replaying speculative decoding.

vLLM's acceptance length is generated tokens per verification: the target accepts the
leading correct part of the draft's chain, adds one token, and the next verification
starts after that. Easy stretches are crossed in few verifications, hard ones in many,
so a per-position accuracy averaged over every token overestimates acceptance; the
replay lands on what vLLM measures (BENCHMARKS.md, "Offline acceptance estimate"). Along
each reply it starts after the target's first reply token (vLLM drafts nothing before
it) and jumps by accepted + 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby, zip_longest
from typing import Any

OVERALL = "overall"  # the row that adds the counts of every category (or source)


@dataclass(frozen=True)
class Acceptance:
    """Acceptance as counts, however measured, so figures combine by adding counts.

    `drafts`: verification steps that checked a proposal; `accepted_per_position[k]`:
    those whose first k+1 proposed tokens were accepted; `accepted`: accepted tokens in
    all (vLLM counts it apart)."""

    drafts: int = 0
    accepted: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @classmethod
    def from_counts(
        cls, drafts: float, accepted: float, accepted_per_position: Iterable[float]
    ) -> Acceptance:
        """From counter values (Prometheus exposes them as floats)."""
        return cls(round(drafts), round(accepted), tuple(round(a) for a in accepted_per_position))

    @classmethod
    def from_record(cls, fields: Mapping[str, Any]) -> Acceptance:
        """From its `dataclasses.asdict` form (a reuse record)."""
        return cls(fields["drafts"], fields["accepted"], tuple(fields["accepted_per_position"]))

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verification, `1 + accepted / drafts`. None without a draft: nothing
        was proposed (vLLM's n-gram finds no match in a prompt), which is not a rate of 1."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    @property
    def per_position(self) -> list[float]:
        """Acceptance rate of each draft position, as vLLM reports it (not conditional)."""
        return [a / self.drafts for a in self.accepted_per_position] if self.drafts else []

    def __add__(self, other: Acceptance) -> Acceptance:
        positions = zip_longest(self.accepted_per_position, other.accepted_per_position)
        return Acceptance(
            self.drafts + other.drafts,
            self.accepted + other.accepted,
            tuple((a or 0) + (b or 0) for a, b in positions),
        )


class WithAcceptance:
    """The figures a user reads, for a record that holds its counts as `acceptance`."""

    acceptance: Acceptance

    @property
    def acceptance_length(self) -> float | None:
        return self.acceptance.acceptance_length

    @property
    def per_position(self) -> list[float]:
        return self.acceptance.per_position

    @property
    def drafts(self) -> int:
        return self.acceptance.drafts


def combine(parts: Iterable[Acceptance]) -> Acceptance:
    """Several sets of counts as one: every count summed (acceptance weighted by drafts)."""
    return sum(parts, Acceptance())


def replay_runs(
    lead: Sequence[int], supervised: Sequence[bool], segment: Sequence[int]
) -> list[tuple[int, list[int]]]:
    """Per supervised run of a packed batch, in order: (segment, the accepted draft tokens
    of each verification). `lead` is `Eagle3Draft`'s leading right steps per position,
    `supervised` the step-0 validity (the shifted loss mask)."""
    runs, positions = [], zip(supervised, segment, lead, strict=True)
    for (mask, seg), group in groupby(positions, key=lambda x: x[:2]):
        if not mask:
            continue
        leads, accepted, j = [x[2] for x in group], [], 0
        while j < len(leads):
            accepted.append(leads[j])
            j += leads[j] + 1
        runs.append((seg, accepted))
    return runs


def summarize(
    replies: Iterable[Sequence[int]], positions: int, max_tokens: int | None = None
) -> Acceptance:
    """Acceptance over replayed replies. With `max_tokens`, each reply is cut where a
    generation of that many tokens stops (its first token comes from prefill, undrafted),
    so the figure compares with a vLLM measurement generating `max_tokens` per prompt."""
    verifications, accepted = 0, [0] * positions
    for reply in replies:
        generated = 1
        for count in reply:
            if max_tokens is not None and generated >= max_tokens:
                break
            verifications += 1
            for k in range(min(count, positions)):
                accepted[k] += 1
            generated += count + 1
    return Acceptance(verifications, sum(accepted), tuple(accepted))


def replies_of(walks: dict[str, list[list[int]]]) -> list[list[int]]:
    return [reply for row in walks.values() for reply in row]
