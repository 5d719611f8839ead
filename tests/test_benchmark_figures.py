"""Benchmark rounds and figures (pure functions over counter sums), and what the
benchmark service refuses before starting anything."""

from __future__ import annotations

import pytest

from mm_assets.domain.model.acceptance import OVERALL, Acceptance
from mm_assets.domain.model.benchmark import (
    BenchmarkFigures,
    Generation,
    PromptFigures,
    benchmark_conversation,
    capped,
    combined,
    comparison,
    figures_of,
    intervals,
    lossless_count,
    round_prompt,
    with_overall,
)

IMAGE = {"type": "image", "path": "/coco/a.jpg"}


def _figures(category: str, method: str, **sums) -> BenchmarkFigures:
    fields = {
        "prompts": 2, "requests": 4, "output_tokens": 100, "latency_s": 2.0,
        "time_per_output_token_sum_s": 0.08, "time_per_output_token_count": 4,
    }  # fmt: skip
    return BenchmarkFigures(category, method, **{**fields, **sums})


def test_rounds_quote_the_targets_answers_and_drop_the_datasets() -> None:
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [IMAGE, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "the dataset's answer"},
        {"role": "user", "content": "And the colour?"},
        {"role": "assistant", "content": "another dataset answer"},
    ]
    conv = benchmark_conversation(turns)
    assert conv.rounds == 2
    assert round_prompt(conv, [], 0) == turns[:2]
    second = round_prompt(conv, ["A cat."], 1)
    assert second == [
        turns[0], turns[1], {"role": "assistant", "content": "A cat."}, turns[3]
    ]  # fmt: skip
    with pytest.raises(ValueError, match="needs the answers"):
        round_prompt(conv, [], 1)
    with pytest.raises(ValueError, match="at least one user turn"):
        benchmark_conversation([{"role": "system", "content": "x"}])


def test_capped_keeps_the_first_conversations_of_each_category() -> None:
    cats = {"a": [[1], [2], [3]], "b": [[4]]}
    assert capped(cats, 2) == {"a": [[1], [2]], "b": [[4]]}  # type: ignore[dict-item]
    assert capped(cats, None) == cats  # type: ignore[arg-type]


def test_figures_are_read_from_counter_sums() -> None:
    f = _figures("code", "ngram", acceptance=Acceptance(10, 15, (8, 5, 2)))
    assert f.acceptance_length == pytest.approx(2.5)
    assert f.per_position == pytest.approx([0.8, 0.5, 0.2])
    assert f.tokens_per_s == pytest.approx(50.0)
    assert f.mean_time_per_output_token_ms == pytest.approx(20.0)
    plain = _figures("code", "none")
    assert plain.acceptance_length is None and plain.per_position == []


def test_categories_combine_as_one_counter_difference_would() -> None:
    """Acceptance weighted by drafts (not a mean of the categories' lengths), tokens/s as
    Σ tokens ÷ Σ latency (not a mean of rates)."""
    easy = _figures(
        "easy",
        "ngram",
        output_tokens=90,
        latency_s=1.0,
        acceptance=Acceptance(30, 60, (25, 20, 15)),
        lossless=4,
        compared=4,
    )
    hard = _figures(
        "hard",
        "ngram",
        output_tokens=10,
        latency_s=1.0,
        acceptance=Acceptance(10, 0, (0, 0)),
        lossless=3,
        compared=4,
    )
    total = combined([easy, hard])
    assert total.category == OVERALL and total.method == "ngram"
    assert total.acceptance_length == pytest.approx(1 + 60 / 40)
    assert total.per_position == pytest.approx([25 / 40, 20 / 40, 15 / 40])
    assert total.tokens_per_s == pytest.approx(100 / 2.0)
    assert total.mean_time_per_output_token_ms == pytest.approx(1000 * 0.16 / 8)
    assert (total.prompts, total.requests, total.lossless, total.compared) == (4, 8, 7, 8)
    with pytest.raises(ValueError, match="one method"):
        combined([easy, _figures("easy", "none")])
    assert combined([_figures("a", "none"), _figures("b", "none")]).lossless is None


def test_the_overall_rows_follow_the_categories() -> None:
    rows = with_overall([
        _figures("a", "none", output_tokens=100, latency_s=4.0),
        _figures("b", "none", output_tokens=100, latency_s=1.0),
        _figures("a", "ngram", output_tokens=100, latency_s=2.0),
        _figures("b", "ngram", output_tokens=100, latency_s=2.0),
    ])  # fmt: skip
    by = {(r.category, r.method): r for r in rows}
    assert by[OVERALL, "ngram"].tokens_per_s == pytest.approx(200 / 4)
    assert by[OVERALL, "none"].tokens_per_s == pytest.approx(200 / 5)
    assert [r.category for r in rows[-2:]] == [OVERALL, OVERALL]


def test_lossless_counts_identical_greedy_outputs_at_the_same_max_tokens() -> None:
    pairs = [([1, 2], [1, 2]), ([3], [3, 9]), ([4, 5], [4, 5]), ([6, 7], [6, 8])]
    limited = [(Generation.limited(a, 2), Generation.limited(b, 2)) for a, b in pairs]
    assert lossless_count(limited) == 2  # an answer that ended early is not a cut one


def _record(method: str, conversation: int, round_: int = 0, **figures) -> PromptFigures:
    fields = {"output_tokens": 20, "latency_s": 1.0, "decode_s": 0.95, "lossless": None}
    fields["depth"] = None if method == "none" else 3
    return PromptFigures("cat", method, conversation, round_, **{**fields, **figures})


def test_a_rows_figures_are_the_sums_of_its_requests() -> None:
    records = [
        _record("eagle3", 0, 0, acceptance=Acceptance(5, 6, (4, 2)), lossless=True),
        _record("eagle3", 0, 1, acceptance=Acceptance(5, 4, (3, 1)), lossless=False),
        _record("eagle3", 1, 0, output_tokens=11, decode_s=None, lossless=True,
                acceptance=Acceptance(4, 4, (3, 1))),
    ]  # fmt: skip
    row = figures_of("cat", ("eagle3", 3), records)
    assert (row.prompts, row.requests, row.output_tokens) == (2, 3, 51)
    assert row.acceptance == Acceptance(14, 14, (10, 4))
    assert row.tokens_per_s == pytest.approx(51 / 3.0)
    assert row.mean_time_per_output_token_ms == pytest.approx(1000 * 1.9 / 38)  # decoded only
    assert (row.lossless, row.compared) == (2, 3)
    assert row.depth == 3
    assert figures_of("cat", ("none", None), [_record("none", 0, depth=None)]).lossless is None


def test_a_rows_intervals_resample_conversations_and_the_speedup_is_paired() -> None:
    """Twelve conversations of two rounds; the draft is 1.5x faster on each, which the
    paired speed-up interval sees however much the conversations differ in speed."""
    records = []
    for i in range(12):
        for k in range(2):
            seconds = 0.5 + i * 0.3 + k * 0.1
            accepted = i % 4 + k
            records.append(_record("none", i, k, latency_s=seconds))
            draft = Acceptance(10, accepted, (accepted,))
            records.append(_record("eagle3", i, k, latency_s=seconds / 1.5, acceptance=draft))
    found = intervals(records, ("eagle3", 3), "cat")
    assert found.acceptance_length is not None and found.acceptance_length.n == 12
    assert found.acceptance_length.value == pytest.approx(1 + 48 / 240)
    assert found.acceptance_length.low < found.acceptance_length.value
    assert found.speedup is not None and found.speedup.value == pytest.approx(1.5)
    assert found.speedup.low == pytest.approx(1.5) and found.speedup.high == pytest.approx(1.5)
    none = intervals(records, ("none", None), "cat")
    assert none.acceptance_length is None and none.speedup is None
    assert none.tokens_per_s is not None and none.tokens_per_s.low < none.tokens_per_s.high
    versus = comparison(records, (("eagle3", 3), ("none", None)), OVERALL, "tokens_per_s")
    assert versus == found.speedup
    assert comparison(records, (("eagle3", 3), ("ngram", 3)), "cat", "tokens_per_s") is None
    assert comparison(records, (("eagle3", 5), ("none", None)), "cat", "tokens_per_s") is None


def test_benchmarking_refuses_external_servers_it_cannot_reconfigure(tmp_path) -> None:
    from mm_assets.domain.model.settings import BenchmarkSettings
    from mm_assets.services.benchmarking import benchmark
    from mm_assets.services.engine import Serving, VllmEngine

    engine = VllmEngine(base_urls=("http://fleet:8000/v1",))
    serving = Serving(engine, tmp_path, None, tmp_path / "l")
    with pytest.raises(ValueError, match="managed vllm resource"):
        benchmark(serving, {}, None, BenchmarkSettings(), tmp_path)


def test_a_speedup_pairs_with_no_speculation_sent_in_turn_with_it() -> None:
    """The machine slowed down after no speculation's own pass: its requests sent in turn
    with the draft's drifted with them, so the speed-up reads from those."""
    records = []
    for i in range(6):
        records.append(_record("none", i, latency_s=1.0))  # measured before the drift
        records.append(_record("none", i, latency_s=3.0, beside="eagle3@3"))
        records.append(_record("eagle3", i, latency_s=2.0))
    found = intervals(records, ("eagle3", 3), "cat")
    assert found.speedup is not None and found.speedup.value == pytest.approx(1.5)
    none = intervals(records, ("none", None), "cat")  # its own row: its own pass only
    assert none.tokens_per_s is not None and none.tokens_per_s.value == pytest.approx(20.0)


def test_methods_are_sent_each_batch_in_turn_the_order_rotating_and_grouped_by_depth() -> None:
    from mm_assets.domain.model.benchmark import NONE
    from mm_assets.services.benchmarking import _groups
    from mm_assets.services.method_runs import _batches, _turns

    methods = [NONE, ("ngram", 3), ("eagle3", 3)]
    firsts = [_turns(methods, at)[0] for at in range(6)]
    assert firsts == methods + methods and sorted(_turns(methods, 4)) == sorted(methods)
    conversations = {
        "a": [benchmark_conversation([{"role": "user", "content": q}] * n) for q, n in
              (("x", 1), ("y", 2), ("z", 1))],
        "b": [benchmark_conversation([{"role": "user", "content": "w"}] * 2)],
    }  # fmt: skip
    assert _batches(conversations, 0, 2) == [[("a", 0), ("a", 1)], [("a", 2), ("b", 0)]]
    assert _batches(conversations, 1, 1) == [[("a", 1)], [("b", 0)]]
    plan = dict.fromkeys([NONE, ("ngram", 1), ("eagle3", 1), ("ngram", 3), ("eagle3", 3)])
    fresh = [[NONE, ("ngram", 1), ("eagle3", 1)], [NONE, ("ngram", 3), ("eagle3", 3)]]
    assert _groups([1, 3], plan, {}, together=True) == fresh
    recorded = dict.fromkeys([NONE, ("ngram", 3), ("eagle3", 3)])
    assert _groups([1, 3], plan, recorded, together=True) == [fresh[0]]  # none: as the pair
    assert _groups([1, 3], plan, dict.fromkeys(plan), together=True) == []
    alone = _groups([1, 3], plan, recorded, together=False)
    assert alone == [[("ngram", 1)], [("eagle3", 1)]]  # a GPU: one server at a time
