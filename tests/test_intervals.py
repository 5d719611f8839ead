"""Bootstrap intervals of ratio figures (`domain.model.intervals`)."""

from __future__ import annotations

import numpy as np
import pytest

from mm_assets.domain.model.intervals import Interval, paired_ratio_interval, ratio_interval


def _prompts(n: int, rate: float, seed: int) -> tuple[list[int], list[int]]:
    """Accepted and drafted tokens of `n` prompts whose draft lands `rate` of its tokens."""
    rng = np.random.default_rng(seed)
    drafts = rng.integers(10, 40, size=n)
    return list(rng.binomial(drafts * 3, rate)), list(drafts)


def test_the_figure_is_the_ratio_of_sums_and_its_interval_holds_it() -> None:
    accepted, drafts = _prompts(40, 0.5, seed=1)
    found = ratio_interval(accepted, drafts, offset=1.0)
    assert found is not None and found.n == 40
    assert found.value == pytest.approx(1 + sum(accepted) / sum(drafts))
    assert found.low < found.value < found.high
    assert 0.01 < found.half_width < 0.2


def test_more_prompts_give_a_narrower_interval() -> None:
    few = ratio_interval(*_prompts(10, 0.5, seed=2), offset=1.0)
    many = ratio_interval(*_prompts(160, 0.5, seed=2), offset=1.0)
    assert few is not None and many is not None
    assert many.half_width < few.half_width / 2


def test_a_rerun_gives_the_same_interval() -> None:
    data = _prompts(30, 0.4, seed=3)
    assert ratio_interval(*data, offset=1.0) == ratio_interval(*data, offset=1.0)


def test_the_interval_covers_the_true_rate_about_as_often_as_it_says() -> None:
    """Over many benchmarks drawn from one draft, the 95% interval holds the draft's true
    acceptance length in roughly 95% of them (a coarse check of the method)."""
    true_length = 1 + 3 * 0.5
    held = 0
    for seed in range(100):
        found = ratio_interval(*_prompts(40, 0.5, seed=100 + seed), offset=1.0)
        assert found is not None
        held += found.low <= true_length <= found.high
    assert 85 <= held <= 100


def test_no_drafts_means_no_acceptance_length_not_a_rate_of_one() -> None:
    assert ratio_interval([0, 0, 0], [0, 0, 0], offset=1.0) is None


def test_prompts_that_all_agree_give_a_point_interval() -> None:
    found = ratio_interval([2, 2, 2], [1, 1, 1], offset=1.0)
    assert found == Interval(3.0, 3.0, 3.0, 3)


def test_a_paired_comparison_sees_a_small_gain_that_unpaired_intervals_overlap_on() -> None:
    """Prompts differ a lot in length; a method 5% faster on every one of them is seen as
    faster by the paired interval, while the two methods' own intervals overlap."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(20, 200, size=40).astype(float)
    seconds = tokens / rng.uniform(5, 50, size=40)  # prompts run at very different speeds
    faster = seconds / 1.05
    slow = ratio_interval(tokens, seconds)
    fast = ratio_interval(tokens, faster)
    assert slow is not None and fast is not None and fast.low < slow.high
    paired = paired_ratio_interval((tokens, faster), (tokens, seconds))
    assert paired is not None
    assert paired.value == pytest.approx(1.05)
    assert paired.low > 1.0


def test_a_paired_comparison_needs_the_same_prompts() -> None:
    with pytest.raises(ValueError, match="same prompts"):
        paired_ratio_interval(([1, 2], [1, 1]), ([1, 2, 3], [1, 1, 1]))


def test_a_prompt_without_a_finite_figure_is_an_error() -> None:
    with pytest.raises(ValueError, match="not finite"):
        ratio_interval([1.0, float("nan")], [1.0, 1.0])


def test_interval_text_names_the_prompts() -> None:
    assert Interval(1.4744, 1.4, 1.55, 30).text() == "1.474 [1.400, 1.550] n=30"


def test_over_categories_prompts_are_resampled_within_their_category() -> None:
    """Two categories a draft finds easy and hard: the benchmark's mix of them is fixed,
    so the overall interval is the stratified one, narrower than a draw that lets the mix
    vary, and it still holds the true figure about as often as it says."""
    true_accepted = 0.0
    held, narrower = 0, 0
    for seed in range(60):
        easy, easy_drafts = _prompts(40, 0.8, seed=300 + seed)
        hard, hard_drafts = _prompts(40, 0.1, seed=400 + seed)
        accepted, drafts = easy + hard, easy_drafts + hard_drafts
        strata = ["easy"] * 40 + ["hard"] * 40
        stratified = ratio_interval(accepted, drafts, 1.0, strata)
        pooled = ratio_interval(accepted, drafts, 1.0)
        assert stratified is not None and pooled is not None
        assert stratified.value == pooled.value and stratified.n == 80
        narrower += stratified.high - stratified.low < pooled.high - pooled.low
        true_accepted = 1 + 3 * (0.8 * sum(easy_drafts) + 0.1 * sum(hard_drafts)) / sum(drafts)
        held += stratified.low <= true_accepted <= stratified.high
    assert narrower >= 55 and 50 <= held <= 60


def test_a_category_of_one_prompt_is_resampled_with_the_others() -> None:
    found = ratio_interval([1, 2, 3, 5], [2, 2, 2, 2], 1.0, ["a", "a", "a", "b"])
    assert found is not None and found.low < found.value < found.high


def test_a_lever_helps_only_beyond_the_prompts_and_the_seeds() -> None:
    """`bench/training_levers.py`'s verdict: the paired interval over prompts must clear 1,
    and the mean over seeds must clear what a seed alone moves today's recipe."""
    from bench.training_levers import seed_margin, verdict

    floor = {"by_seed": {1: 0.95, 2: 1.05}}  # today's recipe under two more seeds
    margin = seed_margin(floor, 3)
    assert margin == pytest.approx(2 * 0.05 / 3**0.5)

    def lever(ratio: float, low: float, high: float) -> dict:
        return {"ratio": {"value": ratio, "low": low, "high": high},
                "by_seed": {0: ratio, 1: ratio, 2: ratio}}  # fmt: skip

    assert verdict(lever(1.10, 1.05, 1.15), margin) == "helps"
    assert verdict(lever(1.03, 1.01, 1.05), margin) == "within noise"  # prompts: yes; seeds: no
    assert verdict(lever(1.10, 0.98, 1.20), margin) == "within noise"  # seeds: yes; prompts: no
    assert verdict(lever(0.88, 0.84, 0.93), margin) == "hurts"
