"""Experiment tracking through the real training loop, read back with each tool's own
reader: TensorBoard's event files and MLflow's local store (SQLite: MLflow 3 refuses the
old file store by default)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_assets.domain.model.settings import SpeculatorSettings, TrackingSettings
from mm_assets.domain.model.trainer import TrainingRun, train
from mm_assets.services.tracking import Tracking, open_tracker
from tests.test_eagle3 import _model, _states, _write_refs

SETTINGS = SpeculatorSettings(
    epochs=2, learning_rate=2e-3, batch_tokens=30, ttt_steps=2, lr_schedule="linear"
)


def _tracked(tmp_path: Path, kind: str) -> tuple:
    refs = _write_refs(tmp_path, [9, 14, 7, 11, 13, 8, 10, 12])
    tracking = Tracking(TrackingSettings(tracking=kind), "run-123")
    params = SETTINGS.model_dump()
    tracker = open_tracker(tracking, "chat", params, tmp_path / "root")
    try:
        run = TrainingRun(log=tracker.log)
        result = train(_model(), refs[:6], refs[6:], SETTINGS, _states(tmp_path), run=run)
    finally:
        tracker.close()
    return result, tracker


def test_tensorboard_gets_every_step_and_epoch(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, _ = _tracked(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "root/tracking/tensorboard/chat/run-123")).Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, len(losses) + 1))
    assert losses == pytest.approx(result.batch_losses, rel=1e-6)
    rates = [e.value for e in events.Scalars("train/lr")]
    assert rates == pytest.approx(result.batch_learning_rates) and rates[0] > rates[-1]
    held_out = [e.value for e in events.Scalars("held_out/acceptance_estimate")]
    assert held_out == pytest.approx(result.epoch_acceptance)
    assert [e.step for e in events.Scalars("held_out/loss")][-1] == len(losses)
    assert (
        "lr_schedule"
        in events.Tensors("settings/text_summary")[0].tensor_proto.string_val[0].decode()
    )


def test_mlflow_gets_the_run_its_settings_and_curves(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    result, tracker = _tracked(tmp_path, "mlflow")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'root/tracking/mlflow.db'}")
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-123"
    assert run.data.params["launched_by"] == "run-123" and run.data.params["draft"] == "chat"
    assert run.data.params["lr_schedule"] == "linear"
    history = client.get_metric_history(tracker.run_id, "train/loss")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(
        result.batch_losses, rel=1e-6
    )
    epochs = client.get_metric_history(tracker.run_id, "held_out/loss")
    assert [m.value for m in epochs] == pytest.approx(result.epoch_held_out_losses)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "mm_assets/chat"


def test_mlflow_without_a_uri_logs_where_mlflow_tracking_uri_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's own variable, read when the training starts (set after the import here)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'team.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracking = Tracking(TrackingSettings(tracking="mlflow"), "run-9")
    tracker = open_tracker(tracking, "chat", {"seed": 0}, tmp_path / "root")
    tracker.log(1, {"train/loss": 0.5})
    tracker.close()
    run = MlflowClient(tracking_uri=uri).get_run(tracker.run_id)
    assert run.data.metrics["train/loss"] == 0.5 and run.data.params["draft"] == "chat"
    assert not (tmp_path / "root" / "tracking").exists()


def test_no_tracking_opens_nothing(tmp_path: Path) -> None:
    tracker = open_tracker(Tracking(TrackingSettings(), "r"), "chat", {}, tmp_path)
    tracker.log(1, {"train/loss": 1.0})
    tracker.close()
    assert not (tmp_path / "tracking").exists()
    off_rank = open_tracker(
        Tracking(TrackingSettings(tracking="mlflow"), "r"), "c", {}, tmp_path, 1
    )
    off_rank.close()
    assert not (tmp_path / "tracking").exists()  # only rank 0 tracks under torchrun
