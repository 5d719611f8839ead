"""95% bootstrap intervals for the figures a benchmark reports, and for paired comparisons.

Every figure here is a ratio of sums over prompts (acceptance length = 1 + Σ accepted ÷
Σ drafts; tokens/s = Σ tokens ÷ Σ latency), so the unit resampled is a prompt: its counts
stay together, and a prompt with many verifications weighs what it weighs in the figure.
A benchmark's categories are fixed by its design, not drawn: over several categories
prompts are resampled within their category (stratified), so the interval holds what the
prompts vary by, not how many of each category a draw happened to take.
Two methods measured on the same prompts are compared prompt by prompt (a paired
bootstrap: one draw of prompts serves both sides), which cancels what the prompts share
(their length, how predictable they are) and leaves what the methods differ by.

scipy's `bootstrap` does the resampling (BCa: corrected for the skew and bias a ratio
has); seeded, so a rerun prints the same interval.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0


@dataclass(frozen=True)
class Interval:
    """A figure, its 95% interval and the number of prompts it is over."""

    value: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        """Half the interval's width relative to the figure (0.05: ±5%)."""
        return (self.high - self.low) / 2 / abs(self.value) if self.value else math.inf

    def text(self, digits: int = 3) -> str:
        """`1.474 [1.402, 1.551] n=30`."""
        return f"{self.value:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}] n={self.n}"


def ratio_interval(
    numerators: Sequence[float],
    denominators: Sequence[float],
    offset: float = 0.0,
    strata: Sequence[Hashable] | None = None,
) -> Interval | None:
    """`offset + Σ numerators ÷ Σ denominators` over prompts (one pair each), with its
    interval; None when the denominators sum to 0 (no drafts: no acceptance length).
    With `strata` (a category per prompt), prompts are resampled within their stratum."""
    num, den = _arrays(numerators, denominators)
    if den.sum() <= 0:
        return None

    def figure(n: np.ndarray, d: np.ndarray) -> np.ndarray:
        return offset + _ratio(n, d)

    return _interval([num, den], figure, strata)


def paired_ratio_interval(
    a: tuple[Sequence[float], Sequence[float]],
    b: tuple[Sequence[float], Sequence[float]],
    offset: float = 0.0,
    strata: Sequence[Hashable] | None = None,
) -> Interval | None:
    """How `a` compares with `b` on the same prompts: `(offset + Σa₀ ÷ Σa₁) ÷ (offset +
    Σb₀ ÷ Σb₁)`, resampling prompts for both at once (prompt i of `a` is prompt i of `b`).
    None when either side has nothing to divide by."""
    arrays = [*_arrays(*a), *_arrays(*b)]
    if len(arrays[0]) != len(arrays[2]):
        raise ValueError("a paired comparison needs the same prompts on both sides")
    if arrays[1].sum() <= 0 or arrays[3].sum() <= 0:
        return None
    if offset + arrays[2].sum() / arrays[3].sum() == 0:
        return None

    def figure(an: np.ndarray, ad: np.ndarray, bn: np.ndarray, bd: np.ndarray) -> np.ndarray:
        return _ratio(offset + _ratio(an, ad), offset + _ratio(bn, bd))

    return _interval(arrays, figure, strata)


def _arrays(*columns: Sequence[float]) -> list[np.ndarray]:
    arrays = [np.asarray(c, dtype=float) for c in columns]
    if len({len(a) for a in arrays}) != 1:
        raise ValueError("every prompt needs a value in each column")
    if any(not np.isfinite(a).all() for a in arrays):
        raise ValueError("a prompt's figure is not finite")
    return arrays


def _ratio(num: np.ndarray | float, den: np.ndarray | float) -> np.ndarray:
    """num ÷ den, NaN where a resample drew only prompts with nothing to divide by."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _interval(
    columns: list[np.ndarray],
    figure: Callable[..., np.ndarray],
    strata: Sequence[Hashable] | None,
) -> Interval:
    """`figure` of the columns' sums, and its interval. scipy resamples prompt indices,
    one sample per stratum (so each stratum keeps its size), and a prompt's columns
    travel together."""
    from scipy.stats import bootstrap

    n = len(columns[0])
    value = float(figure(*(c.sum() for c in columns)))
    labels = list(strata) if strata is not None else [0] * n
    if len(labels) != n:
        raise ValueError("every prompt needs a stratum")
    groups = [np.array([i for i, s in enumerate(labels) if s == k]) for k in dict.fromkeys(labels)]
    if min(map(len, groups)) < 2:  # a stratum of one prompt cannot be resampled within
        groups = [np.arange(n)]

    def statistic(*picks: np.ndarray, axis: int = -1) -> np.ndarray:
        return figure(*(sum(c[p].sum(axis=-1) for p in picks) for c in columns))

    if n < 2 or all(np.all(c == c[0]) for c in columns):
        return Interval(value, value, value, n)  # nothing to resample from
    low, high = math.nan, math.nan
    for method in ("BCa", "percentile"):  # BCa is undefined for some degenerate draws
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = bootstrap(
                tuple(groups),
                statistic,
                vectorized=True,
                confidence_level=CONFIDENCE,
                n_resamples=RESAMPLES,
                method=method,
                rng=np.random.default_rng(SEED),
            ).confidence_interval
        low, high = float(found.low), float(found.high)
        if math.isfinite(low) and math.isfinite(high):
            break
    if not (math.isfinite(low) and math.isfinite(high)):
        low, high = _percentile_ignoring_nan(groups, statistic)
    return Interval(value, low, high, n)


def _percentile_ignoring_nan(
    groups: list[np.ndarray], statistic: Callable[..., np.ndarray]
) -> tuple[float, float]:
    """The percentile interval over the resamples that have a figure (a resample of only
    prompts without drafts has none)."""
    rng = np.random.default_rng(SEED)
    picks = [g[rng.integers(0, len(g), size=(RESAMPLES, len(g)))] for g in groups]
    values = statistic(*picks)
    values = values[np.isfinite(values)]
    tail = (1 - CONFIDENCE) / 2 * 100
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))
