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


def test_one_rule_judges_rejected_hidden_states_offline_and_online() -> None:
    """The ratio is against the limit (equal passes); the description counts, names the
    first three and explains token mismatches only when there are some."""
    from mm_assets.domain.rejection import StateRejections

    first = [{"row_id": f"r{i}", "reason": "token_mismatch", "detail": "d"} for i in range(5)]
    at_limit = StateRejections(1, 10, 0.1, first[:1])
    assert at_limit.ratio == 0.1 and not at_limit.too_many
    over = StateRejections(5, 10, 0.1, first, token_mismatches=True)
    text = over.describe()
    assert over.too_many and text.startswith("5/10 rows rejected (50.00%); allowed 10.00%.")
    assert "r2: token_mismatch (d)" in text and "r3" not in text and "placeholder" in text
    assert "placeholder" not in StateRejections(0, 0, 0.0).describe()
    assert not StateRejections(0, 0, 0.0).too_many  # no rows: nothing rejected
