"""What every draft family shares (EAGLE-3 in `eagle3.py`, DFlash in `dflash.py`).

The frozen parts taken from the target (its token embeddings, and the teacher: its
final norm and its lm_head rows of the draft vocabulary), the draft's head over that
vocabulary with the maps vLLM reads (`d2t`, `t2d`), the Llama/Qwen building blocks, and
what a draft's `forward` reports per draft position (`StepStats`): a family computes
its loss its own way, and the trainer, the held-out replay and the acceptance estimate
read the same statistics from either.

A family's model subclasses `DraftModel`, calls `_embeddings()` first and `_heads()`
last in its `__init__` (so parameters are created, and drawn from the seed, in the same
order as before the families were split), and implements
`forward(batch, ttt_steps, loss, target_greedy) -> (loss, [StepStats per draft position])`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mm_assets.domain.model.draft_vocab import DraftVocab


def layer_shape(target_config: dict[str, Any], draft_vocab_size: int) -> dict[str, Any]:
    """The shape of one layer of the target's language model (its text config for a
    vision-language target), as every family's config takes it; the draft vocabulary is
    at most the target's."""
    text = target_config.get("text_config") or target_config
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    rope = text.get("rope_parameters") or {}
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": int(text.get("num_key_value_heads", heads)),
        "head_dim": int(text.get("head_dim") or hidden // heads),
        "intermediate_size": int(text["intermediate_size"]),
        "vocab_size": int(text["vocab_size"]),
        "draft_vocab_size": min(draft_vocab_size, int(text["vocab_size"])),
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        "max_position_embeddings": int(text.get("max_position_embeddings", 4096)),
    }


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, ...]:
    """cos and sin of the default (neox) rope at each position: [P, head_dim] each."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class StepStats:
    """One draft position (EAGLE-3's step s, DFlash's block slot s+1) over a batch."""

    loss: torch.Tensor
    correct: torch.Tensor  # [N] bool, argmax agrees with the teacher
    valid: torch.Tensor  # [N] bool, counted positions


@dataclass
class Teacher:
    """The target's distributions where the loss reads them. `last_hidden` holds layer L
    at the `loss_mask` positions only (a minority of multimodal rows); `slot` maps a
    position of the batch to its row."""

    log_p: torch.Tensor  # [M, draft vocab]
    top: torch.Tensor  # [M]
    slot: torch.Tensor  # [N]

    @classmethod
    @torch.no_grad()
    def of(cls, draft: DraftModel, last_hidden: torch.Tensor, loss_mask: torch.Tensor):
        needed = loss_mask.nonzero().squeeze(-1)
        if last_hidden.shape[0] != needed.numel():
            raise ValueError(
                f"last_hidden has {last_hidden.shape[0]} rows for {needed.numel()} "
                "supervised positions; pass layer L at the loss_mask positions only"
            )
        slot = torch.zeros(loss_mask.shape[0], dtype=torch.long, device=loss_mask.device)
        slot[needed] = torch.arange(needed.numel(), device=loss_mask.device)
        logits = draft.verifier_lm_head(draft.verifier_norm(last_hidden)).float()
        return cls(F.log_softmax(logits, dim=-1), logits.argmax(-1), slot)


def leading_correct(correct: Sequence[torch.Tensor], valid: Sequence[torch.Tensor]) -> torch.Tensor:
    """[N] per position: how many leading draft steps were counted and right (the
    draft tokens vLLM would accept from a chain starting there)."""
    right = torch.stack([c & v for c, v in zip(correct, valid, strict=True)]).long()
    return right.cumprod(dim=0).sum(dim=0)


class DraftModel(nn.Module):
    """The parts of a draft that come from the target or map its vocabulary. A
    subclass sets `cfg` (with `vocab_size`, `hidden_size`, `draft_vocab_size`,
    `rms_norm_eps`, `train_lm_head`, `num_aux`) before `_embeddings()`."""

    cfg: object

    def _embeddings(self) -> None:
        cfg = self.cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)

    def _heads(self) -> None:
        cfg = self.cfg
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(cfg.train_lm_head)
        # the frozen teacher: the target's final norm and its lm_head rows of the draft vocab
        self.verifier_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.verifier_norm.weight.requires_grad_(False)
        self.verifier_lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.verifier_lm_head.weight.requires_grad_(False)
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def init_from_target(
        self,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        final_norm: torch.Tensor,
        vocab: DraftVocab,
    ) -> None:
        """Frozen parts from the target; the draft head starts as the teacher's head."""
        self.attach_target(embed, lm_head, final_norm, vocab)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head[vocab.selected])

    def attach_target(
        self,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        final_norm: torch.Tensor,
        vocab: DraftVocab,
    ) -> None:
        """The frozen parts from the target (embeddings, and the teacher: its final norm
        and lm_head rows of `vocab`), leaving the trained weights as they are."""
        if vocab.size != self.cfg.draft_vocab_size:
            raise ValueError(f"draft vocab {vocab.size} != model's {self.cfg.draft_vocab_size}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            self.verifier_lm_head.weight.copy_(lm_head[vocab.selected])
            self.verifier_norm.weight.copy_(final_norm)
            self.t2d.copy_(vocab.t2d)
            self.d2t.copy_(vocab.d2t)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.draft_vocab_size == self.cfg.vocab_size:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def target_greedy_tokens(
        self, last_hidden: torch.Tensor, full_lm_head: torch.Tensor, chunk: int = 512
    ) -> torch.Tensor:
        """The target's greedy next token at each position (final norm + full lm_head),
        in chunks so `[N, V]` logits are never held at once."""
        out = [
            (self.verifier_norm(last_hidden[i : i + chunk]).float() @ full_lm_head.T).argmax(-1)
            for i in range(0, last_hidden.shape[0], chunk)
        ]
        return torch.cat(out)
