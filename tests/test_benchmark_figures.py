"""Benchmark rounds and figures (pure functions over counter sums), and what the
benchmark service refuses before starting anything."""

from __future__ import annotations

import pytest

from mm_assets.domain.model.acceptance import OVERALL, Acceptance
from mm_assets.domain.model.benchmark import (
    BenchmarkFigures,
    Generation,
    benchmark_conversation,
    capped,
    combined,
    lossless_count,
    round_prompt,
    speedup,
    with_lossless,
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


def test_speedup_is_against_no_speculation_on_the_same_category() -> None:
    rows = with_overall([
        _figures("a", "none", output_tokens=100, latency_s=4.0),
        _figures("b", "none", output_tokens=100, latency_s=1.0),
        _figures("a", "ngram", output_tokens=100, latency_s=2.0),
        _figures("b", "ngram", output_tokens=100, latency_s=2.0),
    ])  # fmt: skip
    by = {(r.category, r.method): r for r in rows}
    assert speedup(by["a", "ngram"], rows) == pytest.approx(2.0)
    assert speedup(by["b", "ngram"], rows) == pytest.approx(0.5)
    assert speedup(by[OVERALL, "ngram"], rows) == pytest.approx((200 / 4) / (200 / 5))
    assert speedup(by["a", "ngram"], rows[2:]) is None  # no `none` row to compare with
    assert [r.category for r in rows[-2:]] == [OVERALL, OVERALL]


def test_lossless_counts_identical_greedy_outputs_at_the_same_max_tokens() -> None:
    pairs = [([1, 2], [1, 2]), ([3], [3, 9]), ([4, 5], [4, 5]), ([6, 7], [6, 8])]
    limited = [(Generation.limited(a, 2), Generation.limited(b, 2)) for a, b in pairs]
    assert lossless_count(limited) == 2  # an answer that ended early is not a cut one
    f = with_lossless(_figures("a", "eagle3"), [[1], [2]], [[1], [3]], max_tokens=1)
    assert (f.lossless, f.compared) == (1, 2)
    assert speedup(f, [f]) is None  # no `none` row to compare with
    assert f.acceptance_length is None and f.tokens_per_s == 50.0


def test_benchmarking_refuses_external_servers_it_cannot_reconfigure(tmp_path) -> None:
    from mm_assets.domain.model.benchmark import BenchmarkSettings
    from mm_assets.services.benchmarking import benchmark
    from mm_assets.services.engine import Serving, VllmEngine

    engine = VllmEngine(base_urls=("http://fleet:8000/v1",))
    serving = Serving(engine, tmp_path, None, tmp_path / "l")
    with pytest.raises(ValueError, match="managed vllm resource"):
        benchmark(serving, {}, None, BenchmarkSettings(), tmp_path)
