"""Where each kind of file lives under the storage root, named once: every module that
reads or writes a draft, its baseline, its training state, a record or a log asks here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

WEIGHTS = "model.safetensors"  # a draft's weights in its directory (speculators' layout)
DRAFTS = "speculators"  # trained drafts, under the root and in an object store alike


@dataclass(frozen=True)
class StorageLayout:
    root: Path

    def draft(self, name: str) -> Path:
        """A trained draft (a dataset's or a draft of several datasets'), as vLLM serves it."""
        return self.root / DRAFTS / name

    def untrained_draft(self, name: str) -> Path:
        return self.root / "untrained_speculators" / name

    def train_state(self, name: str) -> Path:
        """Optimizer and progress, kept apart so the draft's directory is only the draft."""
        return self.root / "train_state" / name

    def measurements(self, prompts_of: str) -> Path:
        return self.root / "measurements" / prompts_of

    def benchmark_records(self) -> Path:
        return self.root / "benchmarks" / "records"

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"


def weights(directory: Path) -> Path:
    return directory / WEIGHTS


def has_weights(directory: Path) -> bool:
    return weights(directory).is_file()
