"""Checkpoint files, each replaced atomically: a speculators-format draft directory (its
contents are decided in `domain/model/checkpoint.py`) and the trainer's epoch state."""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mm_assets.common.files import atomic_directory, atomic_path
from mm_assets.storage.layout import WEIGHTS

logger = logging.getLogger(__name__)


def write_checkpoint(out_dir: Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    """config.json + model.safetensors in `out_dir`, replacing it atomically."""
    with atomic_directory(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
    return out_dir


def read_checkpoint_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / WEIGHTS))


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return read_checkpoint_config(path), read_weights(path)


@dataclass(frozen=True)
class TrainStateFile:
    """The training loop's state after its last epoch (`domain.model.trainer.StateStore`)."""

    path: Path

    def load(self, device: torch.device) -> dict[str, Any] | None:
        if not self.path.is_file():
            return None
        try:  # weights_only: a crafted file runs no code
            return torch.load(self.path, map_location=device, weights_only=True)
        except pickle.UnpicklingError as error:  # not a state this trainer wrote: a cache
            logger.warning("ignoring %s, not a training state (%s)", self.path, error)
            return None
        except torch.OutOfMemoryError:
            raise
        # A cut file raises one of these; raised, not ignored: a failing disk reads the
        # same, and starting over would overwrite a state a second try could read.
        except (EOFError, RuntimeError, OSError) as error:
            raise ValueError(
                f"training state {self.path} cannot be read ({type(error).__name__}: {error}); "
                "it is cut short or damaged. Delete it to train from the first epoch, or "
                "rerun with retrain: true"
            ) from error

    def save(self, state: dict[str, Any]) -> None:
        with atomic_path(self.path) as tmp:
            torch.save(state, tmp)

    def __str__(self) -> str:
        return str(self.path)
