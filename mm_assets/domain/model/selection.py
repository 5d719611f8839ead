"""Which epoch's draft a run keeps, and when it stops.

Loss keeps falling after acceptance peaks, so `keep: best_acceptance` keeps the weights
of the epoch whose held-out replay (`acceptance`) estimates the most (the earliest of
equals), and `early_stop_patience` stops once that many epochs in a row found none
higher. The held-out rows then chose the epoch too, so their estimate of the kept draft
leans optimistic by the noise of that choice.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from mm_assets.domain.model.acceptance import replies_of, summarize

logger = logging.getLogger(__name__)


@dataclass
class Evaluation:
    """One epoch's held-out figures (acceptance None: no held-out reply)."""

    epoch: int
    loss: float
    acceptance: float | None
    per_position: list[float] = field(default_factory=list)
    replies: dict[str, list[list[int]]] = field(default_factory=dict)

    @classmethod
    def replayed(
        cls, epoch: int, loss: float, replies: dict[str, list[list[int]]], ttt_steps: int
    ) -> Evaluation:
        """The epoch's figures from the held-out replay (`trainer.evaluate`)."""
        summary = summarize(replies_of(replies), ttt_steps)
        estimate = summary.acceptance_length
        logger.info(
            "epoch %d: held-out loss %.4f, acceptance estimate %s",
            epoch,
            loss,
            "none (no held-out reply)" if estimate is None else f"{estimate:.3f}",
        )
        return cls(epoch, loss, summary.acceptance_length, summary.per_position, replies)

    def metrics(self, train_loss: float) -> dict[str, float]:
        """What experiment tracking logs of the epoch."""
        out = {"epoch": self.epoch, "train/epoch_loss": train_loss, "held_out/loss": self.loss}
        if self.acceptance is not None:
            out["held_out/acceptance_estimate"] = self.acceptance
        return out


@dataclass
class EpochChoice:
    keep: Literal["last", "best_acceptance"] = "last"
    patience: int = 0
    evaluations: list[Evaluation] = field(default_factory=list)
    best: int = 0  # the best evaluation's index
    best_weights: dict[str, torch.Tensor] | None = None

    def record(self, evaluation: Evaluation, model: nn.Module) -> None:
        """Add an epoch's evaluation; remember its weights when it is the best so far."""
        self.evaluations.append(evaluation)
        if len(self.evaluations) == 1 or _above(evaluation, self.evaluations[self.best]):
            self.best = len(self.evaluations) - 1
            if self.keep == "best_acceptance":
                self.best_weights = {
                    name: p.detach().to("cpu", copy=True)
                    for name, p in model.named_parameters()
                    if p.requires_grad
                }

    def stop(self) -> bool:
        """Whether `patience` epochs in a row have passed without a higher estimate."""
        since = len(self.evaluations) - 1 - self.best
        return self.patience > 0 and since >= self.patience

    def kept(self) -> Evaluation:
        return self.evaluations[self.best if self.keep == "best_acceptance" else -1]

    def restore(self, model: nn.Module) -> None:
        """Put the kept epoch's trained weights back (the frozen ones never changed)."""
        if self.keep != "best_acceptance" or self.best == len(self.evaluations) - 1:
            return
        assert self.best_weights is not None
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in self.best_weights:
                    param.copy_(self.best_weights[name].to(param.device))

    def because(self) -> str:
        kept, last = self.kept(), self.evaluations[-1]
        if self.keep == "last":
            return f"keep: last (epoch {last.epoch})"
        if kept is last:
            return f"keep: best_acceptance: epoch {kept.epoch}, the last, has the highest estimate"
        return (
            f"keep: best_acceptance: epoch {kept.epoch}'s held-out estimate "
            f"{_shown(kept.acceptance)} is above the last epoch's ({last.epoch}: "
            f"{_shown(last.acceptance)})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "evaluations": [asdict(e) for e in self.evaluations],
            "best": self.best,
            "best_weights": self.best_weights,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.evaluations = [Evaluation(**e) for e in state["evaluations"]]
        self.best, self.best_weights = state["best"], state["best_weights"]


def _above(a: Evaluation, b: Evaluation) -> bool:
    if a.acceptance is None:
        return False
    return b.acceptance is None or a.acceptance > b.acceptance


def _shown(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f}"
