"""95% bootstrap intervals for the figures a benchmark reports, and for paired comparisons.

Every figure here is a ratio of sums over prompts (acceptance length = 1 + Σ accepted ÷
Σ drafts; tokens/s = Σ tokens ÷ Σ latency), so the unit resampled is a prompt: its counts
stay together, and a prompt with many verifications weighs what it weighs in the figure.
Two methods measured on the same prompts are compared prompt by prompt (a paired
bootstrap: one draw of prompts serves both sides), which cancels what the prompts share
(their length, how predictable they are) and leaves what the methods differ by.

scipy's `bootstrap` does the resampling (BCa: corrected for the skew and bias a ratio
has); seeded, so a rerun prints the same interval.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
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
    numerators: Sequence[float], denominators: Sequence[float], offset: float = 0.0
) -> Interval | None:
    """`offset + Σ numerators ÷ Σ denominators` over prompts (one pair each), with its
    interval; None when the denominators sum to 0 (no drafts: no acceptance length)."""
    num, den = _arrays(numerators, denominators)
    if den.sum() <= 0:
        return None

    def statistic(n: np.ndarray, d: np.ndarray, axis: int = -1) -> np.ndarray:
        return offset + _ratio(n.sum(axis=axis), d.sum(axis=axis))

    return _interval((num, den), statistic)


def paired_ratio_interval(
    a: tuple[Sequence[float], Sequence[float]],
    b: tuple[Sequence[float], Sequence[float]],
    offset: float = 0.0,
) -> Interval | None:
    """How `a` compares with `b` on the same prompts: `(offset + Σa₀ ÷ Σa₁) ÷ (offset +
    Σb₀ ÷ Σb₁)`, resampling prompts for both at once (prompt i of `a` is prompt i of `b`).
    None when either side has nothing to divide by."""
    arrays = [*_arrays(*a), *_arrays(*b)]
    if len(arrays[0]) != len(arrays[2]):
        raise ValueError("a paired comparison needs the same prompts on both sides")
    if arrays[1].sum() <= 0 or arrays[3].sum() <= 0:
        return None
    base = offset + arrays[2].sum() / arrays[3].sum()
    if base == 0:
        return None

    def statistic(
        an: np.ndarray, ad: np.ndarray, bn: np.ndarray, bd: np.ndarray, axis: int = -1
    ) -> np.ndarray:
        mine = offset + _ratio(an.sum(axis=axis), ad.sum(axis=axis))
        theirs = offset + _ratio(bn.sum(axis=axis), bd.sum(axis=axis))
        return _ratio(mine, theirs)

    return _interval(tuple(arrays), statistic)


def _arrays(*columns: Sequence[float]) -> list[np.ndarray]:
    arrays = [np.asarray(c, dtype=float) for c in columns]
    if len({len(a) for a in arrays}) != 1:
        raise ValueError("every prompt needs a value in each column")
    if any(not np.isfinite(a).all() for a in arrays):
        raise ValueError("a prompt's figure is not finite")
    return arrays


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num ÷ den, NaN where a resample drew only prompts with nothing to divide by."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _interval(data: tuple[np.ndarray, ...], statistic) -> Interval:  # type: ignore[no-untyped-def]
    from scipy.stats import bootstrap

    value = float(statistic(*data))
    n = len(data[0])
    if n < 2 or all(np.all(column == column[0]) for column in data):
        return Interval(value, value, value, n)  # nothing to resample from
    low, high = math.nan, math.nan
    for method in ("BCa", "percentile"):  # BCa is undefined for some degenerate draws
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = bootstrap(
                data,
                statistic,
                paired=True,
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
        low, high = _percentile_ignoring_nan(data, statistic)
    return Interval(value, low, high, n)


def _percentile_ignoring_nan(data: tuple[np.ndarray, ...], statistic) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """The percentile interval over the resamples that have a figure (a resample of only
    prompts without drafts has none)."""
    rng = np.random.default_rng(SEED)
    n = len(data[0])
    picks = rng.integers(0, n, size=(RESAMPLES, n))
    values = statistic(*(column[picks] for column in data), axis=-1)
    values = values[np.isfinite(values)]
    tail = (1 - CONFIDENCE) / 2 * 100
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))
