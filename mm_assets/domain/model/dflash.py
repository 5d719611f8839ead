"""The DFlash block draft (what vLLM's `DFlashDraftModel` runs), in plain torch.

One forward pass proposes a block. Slot 0 holds the token the target has just produced
(the anchor), slots 1..K the mask token; slot k predicts the token k places after the
anchor. Every slot attends, without a causal mask, to the whole block and to the
target's context up to the anchor: `fc` of the target's auxiliary hidden states side by
side, normed by `hidden_norm`, which each layer projects to its own keys and values.
The layers are Qwen3's (per-head q/k norms, rope over 1D positions: a vision-language
target's mRoPE is not the draft's, which reads the target's temporal row as vLLM serves
it: the context at its states' positions, slot k at the anchor's state's position + 1 +
k). Embeddings are the target's, frozen; the mask slots read the embedding of
`mask_token_id`.

Training (the DFlash paper's recipe, in this project's batches): every position of a
packed batch whose block reaches a supervised token is an anchor, all blocks in one
pass; slot k's loss (`losses.py`, against the target's distribution at the token it
predicts) is averaged over its anchors and weighted `decay**(k-1)`. Slot k at anchor i
reports what EAGLE-3's step k-1 at position i does (`StepStats`), so the trainer, the
held-out replay and the acceptance estimate read both families alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mm_assets.domain.model.draft_parts import (
    MLP,
    DraftModel,
    RMSNorm,
    StepStats,
    Teacher,
    apply_rotary,
    layer_shape,
    rotary,
)
from mm_assets.domain.model.losses import KL, LossRecipe
from mm_assets.domain.model.training_data import Batch


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    mask_token_id: int
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_aux: int = 3
    train_lm_head: bool = False
    max_anchors: int = 1024
    """Blocks trained per batch at most (a random subset beyond): memory grows with
    anchors × block × tokens."""


class BlockAttention(nn.Module):
    """Qwen3 attention of the block's slots over the context and the block."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(heads * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _keys(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Keys (normed, rotated) and values of `x` [..., H] at `positions` [...], each
        [..., heads, head_dim] with the kv heads repeated for every query head."""
        cfg = self.cfg
        k = self.k_norm(self.k_proj(x).unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim)))
        v = self.v_proj(x).unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
        cos, sin = rotary(positions.flatten(), cfg.head_dim, cfg.rope_theta)
        shape = (*positions.shape, 1, cfg.head_dim)
        k = apply_rotary(k, cos.view(shape), sin.view(shape))
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        return k.repeat_interleave(groups, dim=-2), v.repeat_interleave(groups, dim=-2)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context: torch.Tensor,
        context_positions: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """x [A, B, H] (A blocks of B slots) at `positions` [A, B]; `context` [N, H] at
        `context_positions` [N]; `visible` [A, N]: the context each block may read."""
        cfg = self.cfg
        q = self.q_norm(self.q_proj(x).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim)))
        cos, sin = rotary(positions.flatten(), cfg.head_dim, cfg.rope_theta)
        shape = (*positions.shape, 1, cfg.head_dim)
        q = apply_rotary(q, cos.view(shape), sin.view(shape))
        k, v = self._keys(x, positions)  # [A, B, heads, d]
        ck, cv = self._keys(context, context_positions)  # [N, heads, d]
        scale = cfg.head_dim**-0.5
        on_context = torch.einsum("abhd,nhd->abhn", q, ck) * scale
        on_context = on_context.masked_fill(~visible[:, None, None, :], float("-inf"))
        on_block = torch.einsum("abhd,achd->abhc", q, k) * scale
        weights = torch.cat([on_context, on_block], dim=-1).softmax(dim=-1)
        n = context.shape[0]
        out = torch.einsum("abhn,nhd->abhd", weights[..., :n], cv)
        out = out + torch.einsum("abhc,achd->abhd", weights[..., n:], v)
        return self.o_proj(out.flatten(-2))


class BlockLayer(nn.Module):
    """A decoder layer; parameter names are those vLLM loads."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = BlockAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, *where: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *where)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(DraftModel):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.cfg = cfg
        self._embeddings()
        self.fc = nn.Linear(cfg.num_aux * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([BlockLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._heads()

    def anchors(self, batch: Batch, slots: int) -> torch.Tensor:
        """The positions whose block reaches a supervised token (training: at most
        `max_anchors` of them, drawn from a generator seeded by the batch itself)."""
        n, mask, segment = batch.input_ids.shape[0], batch.loss_mask, batch.segment
        index = torch.arange(n, device=mask.device)
        reaches = torch.zeros_like(mask)
        for k in range(slots):
            ahead = (index + k).clamp(max=n - 1)
            reaches |= (index + k < n) & (segment[ahead] == segment) & mask[ahead]
        found = reaches.nonzero().squeeze(-1)
        if not self.training or found.numel() <= self.cfg.max_anchors:
            return found
        draw = torch.Generator().manual_seed(int(batch.input_ids.sum()) * 31 + n)
        chosen = torch.randperm(found.numel(), generator=draw)[: self.cfg.max_anchors]
        return found[chosen.sort().values.to(found.device)]

    def blocks(self, batch: Batch, anchors: torch.Tensor, masked: int) -> torch.Tensor:
        """[A, 1 + masked, H]: the final hidden state of each slot of the block at each
        anchor (before the head)."""
        segment, device = batch.segment, batch.input_ids.device
        slots = torch.arange(masked + 1, device=device)
        block_ids = torch.full((anchors.numel(), masked + 1), self.cfg.mask_token_id)
        block_ids = block_ids.to(device)
        block_ids[:, 0] = batch.input_ids[anchors]
        positions = batch.position_ids[anchors][:, None] + 1 + slots[None, :]
        index = torch.arange(segment.shape[0], device=device)
        visible = (index[None, :] <= anchors[:, None]) & (
            segment[None, :] == segment[anchors][:, None]
        )
        context = self.hidden_norm(self.fc(batch.aux_hidden))
        x = self.embed_tokens(block_ids)
        for layer in self.layers:
            x = layer(x, positions, context, batch.position_ids, visible)
        return self.norm(x)

    def forward(
        self,
        batch: Batch,
        ttt_steps: int = 3,
        loss: LossRecipe = KL,
        target_greedy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[StepStats]]:
        """Total loss and per-slot statistics for one pre-shifted packed batch, blocks of
        `ttt_steps` masked slots (the draft tokens vLLM asks for). In the batch, position
        i holds the target's state at i and the token after it: the anchor of a block at
        i is `input_ids[i]`, its context the states at positions ≤ i of its sample, and
        slot k predicts `input_ids[i + k]` (the teacher's row of position i + k - 1).
        `target_greedy` as in `Eagle3Draft.forward`."""
        segment, mask, ids = batch.segment, batch.loss_mask, batch.input_ids
        n, device = ids.shape[0], ids.device
        teacher = Teacher.of(self, batch.last_hidden, mask)
        anchors = self.anchors(batch, ttt_steps)
        hidden = self.blocks(batch, anchors, ttt_steps)
        total = hidden.new_zeros((), dtype=torch.float32)
        stats: list[StepStats] = []
        for k in range(1, ttt_steps + 1):
            row = (anchors + k - 1).clamp(max=n - 1)
            ok = (anchors + k - 1 < n) & (segment[row] == segment[anchors]) & mask[row]
            logits = self.lm_head(hidden[ok, k]).float()
            rows = teacher.slot[row[ok]]
            per_anchor = loss.at_positions(teacher.log_p[rows], logits)
            slot_loss = per_anchor.sum() / (per_anchor.numel() + 1e-5) * loss.decay ** (k - 1)
            total = total + slot_loss
            proposed = logits.argmax(-1)
            right = proposed == teacher.top[rows]
            if target_greedy is not None:
                right = self.to_target_ids(proposed) == target_greedy[rows]
            valid = torch.zeros(n, dtype=torch.bool, device=device)
            valid[anchors[ok]] = True
            correct = torch.zeros_like(valid)
            correct[anchors[ok]] = right
            stats.append(StepStats(slot_loss.detach(), correct, valid))
        return total, stats


def dflash_config(
    target_config: dict[str, Any], draft_vocab_size: int, mask_token_id: int, num_layers: int
) -> DFlashConfig:
    """A draft of `num_layers` layers shaped like the target's language model."""
    shape = layer_shape(target_config, draft_vocab_size)
    return DFlashConfig(**shape, mask_token_id=mask_token_id, num_layers=num_layers)
