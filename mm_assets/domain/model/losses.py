"""What a draft step is trained to match, per supervised position: the teacher's
distribution p (the target's final norm and lm_head over the draft vocabulary) against
the draft's q. A recipe is one loss or a weighted mix (`kl`, `kl=0.5,tv=0.5`), applied
at every unroll step with the step decay. The names and definitions are speculators'
(`kl` is its `kl_div`), and `test_conformance.py` checks each against its code.

- `kl`  Σ p (log p − log q): forward KL, EAGLE-3's loss (and speculators' default).
- `rkl` Σ q (log q − log p): reverse KL, mode-seeking (Gu et al. 2024, MiniLLM).
- `jsd` ½ KL(p‖m) + ½ KL(q‖m), m = (p + q) / 2: Jensen–Shannon, bounded and symmetric.
- `tv`  ½ Σ |p − q|: total variation, the divergence D_LK of Leviathan, Kalman and
  Matias (2023), whose speculative sampling accepts a draft token with probability
  α = 1 − D_LK = Σ min(p, q): lowering it raises acceptance directly.
- `nla` −log Σ min(p, q): the negative log of that acceptance probability; its gradient
  grows as acceptance falls, where `tv`'s stays flat (Samarin et al. 2026, "LK Losses:
  Direct Acceptance Rate Optimization for Speculative Decoding", arXiv 2602.23881).
- `lk_hybrid` λ·KL + (1 − λ)·TV with λ = exp(−3·α), α held constant: KL's strong gradient
  while the draft is far off, TV once it overlaps (the same paper's hybrid, η = 3).
- `ce`  −log q(argmax p): cross-entropy with the teacher's greedy token, the token greedy
  verification accepts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mm_assets.domain.model.settings import LOSSES, parse_loss


@dataclass(frozen=True)
class LossRecipe:
    """The loss of every unroll step: `weights` per loss name, step s weighted decay**s."""

    weights: dict[str, float] = field(default_factory=lambda: {"kl": 1.0})
    decay: float = 1.0

    @classmethod
    def of(cls, recipe: str, decay: float) -> LossRecipe:
        return cls(parse_loss(recipe), decay)

    def at_positions(self, log_p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return position_losses(log_p, logits, self.weights)


KL = LossRecipe()  # EAGLE-3's: forward KL, every step weighted alike


def position_losses(
    log_p: torch.Tensor, logits: torch.Tensor, weights: dict[str, float]
) -> torch.Tensor:
    """[M] the recipe's loss at each position, from the teacher's log-probabilities and
    the draft's logits ([M, draft vocab] each, float32)."""
    log_q = F.log_softmax(logits, dim=-1)
    p, q = log_p.exp(), log_q.exp()
    out = log_p.new_zeros(log_p.shape[0])
    for name, weight in weights.items():
        if weight:
            out = out + weight * _loss(name, log_p, log_q, p, q)
    return out


def _loss(
    name: str, log_p: torch.Tensor, log_q: torch.Tensor, p: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    if name == "kl":
        return (p * (log_p - log_q)).sum(-1)
    if name == "rkl":
        return (q * (log_q - log_p)).sum(-1)
    if name == "jsd":
        log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
        return 0.5 * ((p * (log_p - log_m)).sum(-1) + (q * (log_q - log_m)).sum(-1))
    if name == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    if name == "nla":
        return -torch.minimum(p, q).sum(-1).clamp_min(1e-12).log()
    if name == "lk_hybrid":
        accepted = torch.minimum(p, q).sum(-1)
        weight = torch.exp(-3.0 * accepted.detach())
        kl = (p * (log_p - log_q)).sum(-1)
        return weight * kl + (1.0 - weight) * (1.0 - accepted)
    if name == "ce":
        return -log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1)
    raise ValueError(f"loss {name!r}: use one of {', '.join(LOSSES)}")
