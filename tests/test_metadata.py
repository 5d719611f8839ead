"""The plots and tables the assets show in the Dagster UI, as pure functions."""

from __future__ import annotations

import dataclasses

import numpy as np

from mm_assets.assets.metadata import (
    acceptance_plot,
    counts_table,
    length_histogram,
    loss_curve,
)
from mm_assets.domain.model.trainer import TrainResult
from tests.plots import PLOT_SIZE, decode_plot


def _pixels(markdown: object) -> np.ndarray:
    return np.asarray(decode_plot(markdown).convert("RGB"), dtype=np.int16)


def test_plots_are_pngs_that_depend_on_their_data() -> None:
    short = length_histogram([10, 12, 12, 15, 40])
    long = length_histogram(list(range(100, 4000, 7)))
    assert decode_plot(short).size == decode_plot(long).size == PLOT_SIZE
    assert np.abs(_pixels(short) - _pixels(long)).sum() > 0

    falling = TrainResult([2.0, 1.0, 0.5], [5.0 / (i + 1) for i in range(60)])
    falling.epoch_held_out_losses, falling.epoch_acceptance = [2.1, 1.2, 0.7], [1.5, 1.9, 1.8]
    rising = TrainResult([1.0, 2.0, 3.0], [0.1 * i for i in range(60)])
    assert np.abs(_pixels(loss_curve(falling)) - _pixels(loss_curve(rising))).sum() > 0
    kept_last = loss_curve(dataclasses.replace(falling, kept_epoch=3))
    kept_best = loss_curve(dataclasses.replace(falling, kept_epoch=2))
    assert np.abs(_pixels(kept_last) - _pixels(kept_best)).sum() > 0  # the kept epoch shows

    estimate_only = acceptance_plot([0.8, 0.5, 0.3])
    with_vllm = acceptance_plot([0.8, 0.5, 0.3], [0.7, 0.4, 0.1])
    assert decode_plot(with_vllm).size == PLOT_SIZE
    assert np.abs(_pixels(estimate_only) - _pixels(with_vllm)).sum() > 0
    other_vllm = acceptance_plot([0.8, 0.5, 0.3], [0.2, 0.6, 0.9])
    assert np.abs(_pixels(with_vllm) - _pixels(other_vllm)).sum() > 0
    # trained 7 deep, served at 3 tokens (or the reverse): each at its own positions
    deeper = acceptance_plot([0.8, 0.5, 0.3, 0.2, 0.1, 0.1, 0.05], [0.7, 0.4, 0.1])
    assert decode_plot(deeper).size == PLOT_SIZE
    assert decode_plot(acceptance_plot([0.8], [0.7, 0.4, 0.1])).size == PLOT_SIZE


def test_empty_inputs_say_so_instead_of_plotting() -> None:
    assert length_histogram([]).value == "(no rows)"
    assert "no batches" in loss_curve(TrainResult()).value


def test_counts_table_lists_largest_first() -> None:
    table = counts_table({"a": 1, "b": 5, "c": 3}, "reason").value
    rows = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert rows == ["b", "c", "a"]
    assert "(none)" in counts_table({}, "reason").value


def test_progress_logs_at_most_every_interval_with_an_eta() -> None:
    from mm_assets.common.progress import Progress

    now = [0.0]
    lines: list[str] = []
    progress = Progress(lines.append, "rows", total=1000, every_s=30, clock=lambda: now[0])
    for done, t in ((10, 5.0), (300, 30.0), (310, 40.0), (600, 60.0)):
        now[0] = t
        progress.update(done)
    assert lines == ["rows 300/1,000 (10.0/s, ETA 70s)", "rows 600/1,000 (10.0/s, ETA 40s)"]
