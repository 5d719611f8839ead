"""One shape for "this row cannot be used": a reason code for counting and a detail for
the person reading the quarantine table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class RowRejected(Exception):
    def __init__(self, reason: StrEnum, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail

    @property
    def kind(self) -> str:
        """The reason, with the exception that caused it when there is one (two template
        errors of different types are different problems)."""
        cause = self.__cause__
        return (
            self.reason.value if cause is None else f"{self.reason.value} ({type(cause).__name__})"
        )


class SetupProblem(RuntimeError):
    """Rows failing in a way that says the setup is wrong, not the rows: the step stops
    with this instead of quarantining the whole partition."""


class RowFailureWatch:
    """Tells a broken setup (a template the processor cannot render, a bug) from bad rows.

    A per-row rejection is a data problem while it is rare. When one kind of rejection
    takes more than `max_share` of the first `first_rows` rows (or of all rows, in a
    smaller partition of at least `min_rows`), every row is likely to fail the same way:
    `SetupProblem` names the kind, the share and the first offending row.
    """

    def __init__(self, first_rows: int, max_share: float, min_rows: int = 10) -> None:
        self.first_rows, self.max_share, self.min_rows = first_rows, max_share, min_rows
        self.seen = 0
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def observe(self, rejected: RowRejected | None, where: str = "") -> None:
        """One row's outcome (None: it was kept), in row order."""
        if self.seen >= self.first_rows:
            return
        self.seen += 1
        if rejected is not None:
            kind = rejected.kind
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.first.setdefault(kind, f"{where}: {rejected.detail}")
        if self.seen == self.first_rows:
            self.check()

    def check(self) -> None:
        """Raise `SetupProblem` when one kind dominates the rows seen (call it at the end
        too, for partitions smaller than `first_rows`)."""
        if self.seen < self.min_rows or not self.counts:
            return
        kind, count = max(self.counts.items(), key=lambda item: item[1])
        if count > self.max_share * self.seen:
            raise SetupProblem(
                f"{count} of the first {self.seen} rows were rejected the same way "
                f"({kind}); first: {self.first[kind]}. That many points at the setup (the "
                "chat template, the processor, max_length) rather than at the rows: fix it "
                "and rerun, or, if the data really is like that, raise "
                f"max_repeated_rejection_share (now {self.max_share})."
            )


def failed_on(row: str, exc: Exception) -> RuntimeError:
    """An unexpected exception on one row, re-raised with the row named: it is a bug or
    a setup problem, never quarantined (it would hide in thousands of rows)."""
    return RuntimeError(
        f"{row} failed with {type(exc).__name__}: {exc} — not a known data problem, so the "
        "step stops instead of quarantining the rest of the partition like it"
    )


@dataclass(frozen=True)
class StateRejections:
    """The rows whose hidden states vLLM's answers failed (token ids, shapes, values),
    judged by one rule offline (the `hidden_states` check) and online (each pass)."""

    rejected: int
    rows: int
    allowed: float  # `max_rejection_ratio`
    first: Sequence[Mapping[str, str]] = ()  # the first rejection rows (row_id, reason, detail)
    token_mismatches: bool = False

    @property
    def ratio(self) -> float:
        return self.rejected / max(self.rows, 1)

    @property
    def too_many(self) -> bool:
        return self.ratio > self.allowed

    def describe(self) -> str:
        """The count against the limit, the first few, and what token mismatches mean."""
        first = "; ".join(f"{r['row_id']}: {r['reason']} ({r['detail']})" for r in self.first[:3])
        text = (
            f"{self.rejected}/{self.rows} rows rejected ({self.ratio:.2%}); allowed "
            f"{self.allowed:.2%}." + (f" First: {first}." if first else "")
        )
        if self.token_mismatches:
            text += (
                " Token mismatches mean vLLM expanded the stored input_ids differently (every "
                "row is sent as its ids): check the image placeholder counts, i.e. that the "
                "processor and its image size limits match the served model."
            )
        return text
