"""Telling a broken setup from bad rows (`RowFailureWatch`, `failed_on`)."""

from __future__ import annotations

from enum import StrEnum

import pytest

from mm_assets.domain.rejection import RowFailureWatch, RowRejected, SetupProblem, failed_on


class Reason(StrEnum):
    BAD = "bad"
    OTHER = "other"


def _rejected(reason: Reason = Reason.BAD, cause: Exception | None = None) -> RowRejected:
    exc = RowRejected(reason, "detail")
    exc.__cause__ = cause
    return exc


def test_one_kind_taking_most_of_the_first_rows_stops_the_step() -> None:
    watch = RowFailureWatch(first_rows=10, max_share=0.5)
    for i in range(4):
        watch.observe(_rejected(), f"row {i}")
        watch.observe(None)
    watch.observe(_rejected(), "row 8")
    with pytest.raises(SetupProblem, match=r"6 of the first 10 rows .*\(bad\); first: row 0"):
        watch.observe(_rejected(), "row 9")  # judged at the 10th row


def test_rare_or_mixed_rejections_are_data_problems() -> None:
    watch = RowFailureWatch(first_rows=10, max_share=0.5)
    for i in range(10):
        watch.observe(_rejected(Reason.BAD if i % 2 else Reason.OTHER), f"row {i}")
    for _ in range(100):  # after the first rows nothing is counted
        watch.observe(_rejected())
    watch.check()
    assert watch.seen == 10


def test_the_cause_type_splits_a_reason_into_kinds() -> None:
    watch = RowFailureWatch(first_rows=10, max_share=0.5)
    for i in range(10):
        watch.observe(_rejected(cause=KeyError() if i % 2 else ValueError()))
    watch.check()
    assert set(watch.counts) == {"bad (KeyError)", "bad (ValueError)"}


def test_a_small_partition_is_judged_at_the_end_and_a_tiny_one_never() -> None:
    watch = RowFailureWatch(first_rows=100, max_share=0.5, min_rows=10)
    for _ in range(12):
        watch.observe(_rejected())
    with pytest.raises(SetupProblem, match="12 of the first 12"):
        watch.check()
    tiny = RowFailureWatch(first_rows=100, max_share=0.5, min_rows=10)
    for _ in range(9):
        tiny.observe(_rejected())
    tiny.check()


def test_an_unexpected_exception_names_the_row() -> None:
    error = failed_on("tokenizing sample abc", KeyError("input_ids"))
    assert "tokenizing sample abc failed with KeyError: 'input_ids'" in str(error)
