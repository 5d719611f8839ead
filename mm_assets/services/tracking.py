"""Experiment tracking: a training's curves where ML engineers compare runs.

`tracking: tensorboard` writes TensorBoard event files; `tracking: mlflow` logs to an
MLflow tracking server, or a local SQLite store (MLflow 3 refuses its old file store).
Off by default: the packages are the `tracking` extra.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mm_assets.domain.model.settings import TrackingSettings

MLFLOW_URI_ENV = "MLFLOW_TRACKING_URI"  # MLflow's own: where its clients log when unset


@dataclass(frozen=True)
class Tracking:
    """What a training is tracked with, and what launched it (a Dagster run id)."""

    settings: TrackingSettings
    launched_by: str


class Tracker:
    """No tracking (`tracking: none`); the trackers below do it."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        return None

    def close(self) -> None:
        return None


class TensorBoardTracker(Tracker):
    def __init__(self, log_dir: Path, params: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(log_dir))
        table = "\n".join(f"| {key} | {value} |" for key, value in sorted(params.items()))
        self.writer.add_text("settings", "| setting | value |\n|---|---|\n" + table)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class MlflowTracker(Tracker):
    def __init__(self, uri: str, experiment: str, run: str, params: Mapping[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run).info.run_id
        for key, value in params.items():
            self.client.log_param(self.run_id, key, value)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.client.log_metric(self.run_id, name, value, step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_tracker(
    tracking: Tracking | None, draft: str, params: Mapping[str, Any], root: Path, rank: int = 0
) -> Tracker:
    """The tracker `tracking` asks for, for one training of `draft` (one per training:
    rank 0's under torchrun); its files under `root`/tracking (TensorBoard's event files,
    MLflow's mlflow.db) unless `tracking_uri` (for MLflow, else `$MLFLOW_TRACKING_URI`,
    read now) says where."""
    if tracking is None or tracking.settings.tracking == "none" or rank != 0:
        return Tracker()
    settings, run = tracking.settings, tracking.launched_by
    every = {**params, "draft": draft, "launched_by": run}
    if settings.tracking == "tensorboard":
        log_dir = Path(settings.tracking_uri or root / "tracking" / "tensorboard")
        return TensorBoardTracker(log_dir / draft / run, every)
    local = f"sqlite:///{(root / 'tracking' / 'mlflow.db').resolve()}"
    uri = settings.tracking_uri or os.environ.get(MLFLOW_URI_ENV) or local
    return MlflowTracker(uri, f"mm_assets/{draft}", run, every)
