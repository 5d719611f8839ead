"""Where each kind of file lives under the storage root, named once: every module that
reads or writes a draft, its baseline, its training state, a record or a log asks here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

WEIGHTS = "model.safetensors"  # a draft's weights in its directory (speculators' layout)
DRAFTS = "speculators"  # trained drafts, under the root and in an object store alike


def child(parent: Path, name: str) -> Path:
    """`parent / name` when `name` is one plain component, so the path stays under `parent`
    (the registry checks names as it loads; this holds whatever the caller passes)."""
    if name in ("", ".", "..") or Path(name).name != name:
        raise ValueError(
            f"{name!r} is not a plain name: {parent / name} would not lie directly under "
            f"{parent}; name drafts and datasets with letters, digits, '_', '-' and '.'"
        )
    return parent / name


@dataclass(frozen=True)
class StorageLayout:
    root: Path

    def draft(self, name: str) -> Path:
        """A trained draft (a dataset's or a draft of several datasets'), as vLLM serves it."""
        return child(self.root / DRAFTS, name)

    def untrained_draft(self, name: str) -> Path:
        return child(self.root / "untrained_speculators", name)

    def train_state(self, name: str) -> Path:
        """Optimizer and progress, kept apart so the draft's directory is only the draft."""
        return child(self.root / "train_state", name)

    def measurements(self, prompts_of: str) -> Path:
        return child(self.root / "measurements", prompts_of)

    def benchmark_records(self) -> Path:
        return self.root / "benchmarks" / "records"

    def log(self, name: str) -> Path:
        return child(self.root / "logs", f"{name}.log")


def weights(directory: Path) -> Path:
    return directory / WEIGHTS


def has_weights(directory: Path) -> bool:
    return weights(directory).is_file()
