"""The EAGLE-3 draft model (what vLLM's `Eagle3LlamaForCausalLM` runs), in plain torch.

`fc` projects the target's three auxiliary hidden states, side by side, to the hidden
size; one Llama-style decoder layer attends over `cat(input_layernorm(token embedding),
hidden_norm(hidden))` (2H wide); a final norm and a head over the draft vocabulary
follow. Embeddings are the target's, frozen.

Training unrolls test-time steps (TTT) as the draft runs at inference: step s reads the
draft's own output of step s-1 at the same position and the token s positions further,
attending to the step-0 keys of its sample up to its position plus its own keys of steps
1..s. A parallel draft (P-EAGLE, `mask_token_id` set) proposes all its tokens in one pass:
its step s reads the mask token and the learned `mask_hidden` instead, with the same
attention, which is what vLLM's `parallel_drafting` runs. The teacher is the target's
final norm and `lm_head` rows of the draft vocabulary over layer L; each step's loss
(`losses.py`) is averaged over supervised positions, weighted `decay**s` and summed.
Batches are pre-shifted as in speculators (`training_data.load_batch`); a position whose
step-s target lies in the next packed sample is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
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
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.domain.model.training_data import Batch

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) of each TTT step so far


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_aux: int = 3
    norm_before_residual: bool = True
    norm_output: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the auxiliary states side by side
    fc_norm: bool = False  # an RMSNorm per auxiliary state (EAGLE-3.1)
    train_lm_head: bool = False
    mask_token_id: int | None = None
    """P-EAGLE (parallel drafting): the token masked slots read; None drafts in turn."""

    @classmethod
    def from_target(cls, target_config: dict[str, Any], draft_vocab_size: int) -> Eagle3Config:
        """A draft shaped like one layer of the target's language model."""
        return cls(**layer_shape(target_config, draft_vocab_size))


def draft_config(target_config: dict[str, Any], settings: SpeculatorSettings) -> Eagle3Config:
    """The draft a training builds for this target: one layer of its shape, with the
    settings' vocabulary size and norms."""
    cfg = Eagle3Config.from_target(target_config, settings.draft_vocab_size)
    norms = {"norm_output", "norm_before_fc", "fc_norm"}
    return replace(cfg, **{name: getattr(settings, name) for name in norms})


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        inner = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(inner, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(inner, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(inner, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor
    ) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        q = self.q_proj(x).view(n, cfg.num_attention_heads, cfg.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)
        cos, sin = rotary(positions, cfg.head_dim, cfg.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache.append((k, v))
        keys = torch.cat([c[0] for c in cache], dim=1)
        values = torch.cat([c[1] for c in cache], dim=1)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=0)
            values = values.repeat_interleave(groups, dim=0)
        # 4-D inputs reach the fused CPU kernel (about twice as fast as 3-D here)
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask)
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))


class FirstLayer(nn.Module):
    """The draft's decoder layer; parameter names are those vLLM and speculators load."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, embeds, hidden, positions, cache, mask) -> torch.Tensor:
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        hidden = residual + self.self_attn(x, positions, cache, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def ttt_mask(segment: torch.Tensor, step: int) -> torch.Tensor:
    """[N, N*(step+1)] boolean: step-0 keys causal within the sample, plus each query's
    own keys of steps 1..step."""
    n = segment.shape[0]
    index = torch.arange(n)
    causal = (index[None, :] <= index[:, None]) & (segment[None, :] == segment[:, None])
    eye = torch.eye(n, dtype=torch.bool)
    return torch.cat([causal | eye, *([eye] * step)], dim=1)


class Eagle3Draft(DraftModel):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self._embeddings()
        self.fc = nn.Linear(cfg.num_aux * cfg.hidden_size, cfg.hidden_size, bias=False)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.num_aux * cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            norms = [RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux)]
            self.fc_norm = nn.ModuleList(norms)
        self.layers = nn.ModuleList([FirstLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.mask_token_id is not None:  # the state masked slots read (vLLM's name)
            self.mask_hidden = nn.Parameter(torch.zeros(cfg.num_aux * cfg.hidden_size))
        self._heads()

    def aux_normed(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The auxiliary states as `fc` reads them: under `norm_before_fc` one norm over
        all of them, under `fc_norm` one per state, in the order vLLM applies them."""
        if self.cfg.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if self.cfg.fc_norm:
            chunks = aux_hidden.chunk(self.cfg.num_aux, dim=-1)
            aux_hidden = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks, strict=True)], -1)
        return aux_hidden

    def _masked_slot(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What every masked slot of a parallel draft reads in place of the token and the
        previous step's output: the mask token's embedding, and `mask_hidden` through
        the auxiliary states' path into `fc` (vLLM's `combine_hidden_states`)."""
        token = torch.full((n,), self.cfg.mask_token_id, device=self.fc.weight.device)
        hidden = self.fc(self.aux_normed(self.mask_hidden[None, :]))
        return self.embed_tokens(token), hidden.expand(n, -1)

    def forward(
        self,
        batch: Batch,
        ttt_steps: int = 3,
        loss: LossRecipe = KL,
        target_greedy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[StepStats]]:
        """Total loss and per-step statistics for one pre-shifted packed batch.

        With `target_greedy` (the target's own next token over its full vocabulary, see
        `target_greedy_tokens`), a step counts as right only when the draft proposes
        exactly that token — what acceptance depends on; without it, agreement with the
        teacher's best token inside the draft vocabulary."""
        segment, loss_mask, ids = batch.segment, batch.loss_mask, batch.input_ids
        n = ids.shape[0]
        teacher = Teacher.of(self, batch.last_hidden, loss_mask)
        hidden = self.fc(self.aux_normed(batch.aux_hidden))
        cache: KVCache = []
        total = hidden.new_zeros((), dtype=torch.float32)
        stats: list[StepStats] = []
        index = torch.arange(n, device=ids.device)
        for step in range(ttt_steps):
            if step and self.cfg.mask_token_id is not None:
                embeds, hidden = self._masked_slot(n)
            else:
                embeds = self.embed_tokens(ids)
            hidden = self.layers[0](
                embeds, hidden, batch.position_ids + step, cache, ttt_mask(segment, step)
            )
            shifted = (index + step).clamp(max=n - 1)
            valid = (index + step < n) & (segment[shifted] == segment) & loss_mask[shifted]
            at = valid.nonzero().squeeze(-1)
            logits = self.lm_head(self.norm(hidden[at])).float()
            if self.cfg.norm_output:
                hidden = self.norm(hidden)
            rows = teacher.slot[shifted[at]]
            per_position = loss.at_positions(teacher.log_p[rows], logits)
            step_loss = per_position.sum() / (at.numel() + 1e-5) * loss.decay**step
            total = total + step_loss
            proposed = logits.argmax(-1)
            correct = torch.zeros_like(valid)
            if target_greedy is None:
                correct[at] = proposed == teacher.top[rows]
            else:
                correct[at] = self.to_target_ids(proposed) == target_greedy[rows]
            stats.append(StepStats(step_loss.detach(), correct, valid))
            ids = torch.cat([ids[1:], ids.new_zeros(1)])
        return total, stats
