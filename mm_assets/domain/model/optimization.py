"""The optimizer and learning-rate schedule of a training run.

`muon`: torch's Muon on the 2-D weights of the layer and `fc`, AdamW on the rest, as
speculators does; Muon's step is scaled to AdamW's RMS (`match_rms_adamw`), so one
`learning_rate` means the same for both. The schedule: a linear warmup over
`warmup_ratio` of the steps, then constant, linear or cosine decay to `min_lr_ratio`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

Schedule = Literal["constant", "linear", "cosine"]


def lr_factor(
    step: int, total: int, schedule: Schedule, warmup_ratio: float, min_lr_ratio: float
) -> float:
    """The rate's multiplier at optimizer step `step` (0-based) of `total`."""
    warmup = math.ceil(warmup_ratio * total)
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class Optimizers:
    """One or two torch optimizers stepped together, each with the same schedule."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], factor: Any) -> None:
        self.optimizers = list(optimizers)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers]

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        for optimizer, scheduler in zip(self.optimizers, self.schedulers, strict=True):
            optimizer.step()
            scheduler.step()

    @property
    def lr(self) -> float:
        return float(self.optimizers[0].param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizers": [o.state_dict() for o in self.optimizers],
            "schedulers": [s.state_dict() for s in self.schedulers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(self.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)


def optimizers(
    model: nn.Module,
    kind: Literal["adamw", "muon"],
    learning_rate: float,
    total_steps: int,
    schedule: tuple[Schedule, float, float],
) -> Optimizers:
    """The run's optimizers over `model`'s trained weights; `schedule` is (kind,
    warmup_ratio, min_lr_ratio)."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    muon = [p for name, p in trained if kind == "muon" and _muon_weight(name, p)]
    chosen = {id(p) for p in muon}
    rest = [p for _, p in trained if id(p) not in chosen]
    parts: list[torch.optim.Optimizer] = []
    if muon:
        parts.append(
            torch.optim.Muon(
                muon, lr=learning_rate, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"
            )
        )
    if rest:
        parts.append(torch.optim.AdamW(rest, lr=learning_rate, weight_decay=0.0))
    kind_of, warmup, floor = schedule
    return Optimizers(
        parts, lambda step: lr_factor(step, max(1, total_steps), kind_of, warmup, floor)
    )


def _muon_weight(name: str, param: torch.Tensor) -> bool:
    """Hidden 2-D weights: Muon orthogonalises matrix updates, which suits neither the
    norms' vectors nor an output head (the Muon authors keep heads on AdamW)."""
    return param.ndim == 2 and "lm_head" not in name
