"""Training recipes through the real loop: every lever resumes to the same weights, the
kept epoch is the best held-out estimate, early stopping, the schedule's rates."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from mm_assets.domain.model.acceptance import replies_of, summarize
from mm_assets.domain.model.selection import EpochChoice, Evaluation
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.domain.model.trainer import TrainingRun, evaluate, noisy, train
from tests.test_eagle3 import _model, _states, _write_refs

EVERY_LEVER = {
    "loss": "kl=1,tv=1,nla=0.5",
    "optimizer": "muon",
    "lr_schedule": "cosine",
    "warmup_ratio": 0.2,
    "min_lr_ratio": 0.1,
    "noise_std": 0.05,
    "keep": "best_acceptance",
}


class _Stop(Exception):
    pass


def _stop_after_first(epoch: int) -> None:
    if epoch == 1:
        raise _Stop


def test_a_run_with_every_lever_resumes_to_the_same_weights(tmp_path: Path) -> None:
    refs = _write_refs(tmp_path, [9, 14, 7, 11, 13, 8, 10, 12])
    settings = SpeculatorSettings(
        epochs=3, learning_rate=2e-3, batch_tokens=30, ttt_steps=2, **EVERY_LEVER
    )
    straight = _model(seed=5)
    whole = train(straight, refs[:6], refs[6:], settings, _states(tmp_path / "straight"))
    resumed = _model(seed=5)
    with pytest.raises(_Stop):
        run = TrainingRun(after_epoch=_stop_after_first)
        train(resumed, refs[:6], refs[6:], settings, _states(tmp_path / "resumed"), run=run)
    resumed = _model(seed=5)
    result = train(resumed, refs[:6], refs[6:], settings, _states(tmp_path / "resumed"))
    assert result.resumed_from_epoch == 1
    assert result.epoch_acceptance == whole.epoch_acceptance and len(whole.epoch_acceptance) == 3
    assert result.batch_learning_rates == whole.batch_learning_rates
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    # the recipe changed what was learned: today's recipe ends elsewhere
    plain = _model(seed=5)
    today = SpeculatorSettings(epochs=3, learning_rate=2e-3, batch_tokens=30, ttt_steps=2)
    train(plain, refs[:6], refs[6:], today, _states(tmp_path / "plain"))
    assert not torch.equal(plain.fc.weight, straight.fc.weight)


def test_the_kept_epoch_has_the_best_estimate_never_below_the_last(tmp_path: Path) -> None:
    refs = _write_refs(tmp_path, [9, 14, 7, 11, 13, 8, 10, 12, 15, 9, 11])
    settings = SpeculatorSettings(
        epochs=5, learning_rate=3e-2, batch_tokens=30, ttt_steps=2, keep="best_acceptance"
    )
    model = _model(seed=2)
    result = train(model, refs[:7], refs[7:], settings, _states(tmp_path))
    estimates = [a for a in result.epoch_acceptance if a is not None]
    assert len(estimates) == 5
    assert result.held_out_acceptance == max(estimates) >= estimates[-1]
    assert result.epoch_acceptance[result.kept_epoch - 1] == max(estimates)
    assert f"epoch {result.kept_epoch}" in result.kept_because
    # the weights left in the model are the kept epoch's: replaying them gives its estimate
    _, replies = evaluate(model, refs[7:], settings)
    assert summarize(replies_of(replies), 2).acceptance_length == result.held_out_acceptance


def _evaluation(epoch: int, acceptance: float | None) -> Evaluation:
    return Evaluation(epoch, loss=1.0 / epoch, acceptance=acceptance)


def test_the_choice_restores_the_best_weights_and_stops_after_patience() -> None:
    model = torch.nn.Linear(2, 2, bias=False)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    model.register_parameter("frozen", frozen)
    choice = EpochChoice("best_acceptance", patience=2)
    weights = {}
    for epoch, acceptance in enumerate([1.5, 1.8, 1.6, 1.7], start=1):
        with torch.no_grad():
            model.weight.fill_(epoch)
        weights[epoch] = model.weight.detach().clone()
        choice.record(_evaluation(epoch, acceptance), model)
        assert choice.stop() == (epoch == 4), epoch  # two epochs without a higher one
    choice.restore(model)
    assert torch.equal(model.weight, weights[2]) and choice.kept().epoch == 2
    assert "epoch 2's held-out estimate 1.800 is above the last epoch's (4: 1.700)" in (
        choice.because()
    )
    copy = EpochChoice("best_acceptance", 2)
    copy.load_state_dict(choice.state_dict())
    assert copy.kept() == choice.kept() and copy.stop()


def test_keep_last_and_no_estimate() -> None:
    model = torch.nn.Linear(2, 2)
    last = EpochChoice("last")
    for epoch, acceptance in enumerate([2.0, 1.0], start=1):
        last.record(_evaluation(epoch, acceptance), model)
    assert last.kept().epoch == 2 and last.best_weights is None and not last.stop()
    blind = EpochChoice("best_acceptance", patience=1)
    for epoch in (1, 2):
        blind.record(_evaluation(epoch, None), model)
    assert blind.kept().epoch == 1 and blind.stop()  # no held-out reply: nothing is better


def test_noise_scales_with_each_states_rms() -> None:
    aux = torch.cat([torch.full((4, 8), 1.0), torch.full((4, 8), 100.0)], dim=1)
    out = noisy(aux, 0.1, 2, torch.Generator().manual_seed(0))
    spread = (out - aux).view(4, 2, 8).std(dim=(0, 2))
    assert 0.05 < spread[0] < 0.2 and 5 < spread[1] < 20


def test_an_epochs_acceptance_estimate_is_logged_to_three_decimals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="mm_assets.domain.model.selection"):
        evaluation = Evaluation.replayed(2, 0.5, {"row": [[1, 0, 0]]}, ttt_steps=3)
        Evaluation.replayed(3, 0.5, {}, ttt_steps=3)
    assert evaluation.acceptance == pytest.approx(4 / 3)
    assert "epoch 2: held-out loss 0.5000, acceptance estimate 1.333" in caplog.messages
    assert "epoch 3: held-out loss 0.5000, acceptance estimate none (no held-out reply)" in (
        caplog.messages
    )
