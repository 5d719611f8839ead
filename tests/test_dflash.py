"""The DFlash block draft: what a block reads, the positions its statistics report (those
EAGLE-3's steps report, so the trainer and the replay read both alike), that it learns,
and the speculators checkpoint vLLM loads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from mm_assets.domain.model.checkpoint import draft_state
from mm_assets.domain.model.dflash import DFlashConfig, DFlashDraft
from mm_assets.domain.model.dflash_checkpoint import checkpoint_config, draft_shape
from mm_assets.domain.model.draft_parts import leading_correct
from mm_assets.domain.model.draft_vocab import build_draft_vocab
from mm_assets.domain.model.eagle3 import Eagle3Config, Eagle3Draft
from mm_assets.domain.model.families import FAMILIES, MROPE_SLOTS
from mm_assets.domain.model.training_data import Batch

CFG = DFlashConfig(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=96, draft_vocab_size=48, mask_token_id=95, num_layers=2,
)  # fmt: skip


def _model(seed: int = 0, cfg: DFlashConfig = CFG) -> DFlashDraft:
    torch.manual_seed(seed)
    model = DFlashDraft(cfg)
    vocab = build_draft_vocab({i: 100 - i for i in range(0, 96, 2)}, 96, cfg.draft_vocab_size)
    model.init_from_target(torch.randn(96, 64), torch.randn(96, 64) * 3, torch.ones(64), vocab)
    return model.eval()


def _batch(lengths: list[int], seed: int = 1, mask: list[int] | None = None) -> Batch:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    loss_mask = torch.tensor(mask, dtype=torch.bool) if mask else torch.ones(n, dtype=torch.bool)
    return Batch(
        input_ids=torch.randint(0, 95, (n,), generator=g),
        aux_hidden=torch.randn(n, 192, generator=g),
        last_hidden=torch.randn(int(loss_mask.sum()), 64, generator=g),
        loss_mask=loss_mask,
        position_ids=torch.cat([torch.arange(1, k + 1) for k in lengths]),
        segment=torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)]),
    )


def test_a_block_reads_its_sample_up_to_its_anchor_and_nothing_after() -> None:
    """The target's states after the anchor are the tokens the block is guessing: a
    block that read them would learn to copy what vLLM never shows it."""
    model, batch = _model(), _batch([6, 5])
    anchors = torch.tensor([2, 8])
    before = model.blocks(batch, anchors, 3)
    assert before.shape == (2, 4, 64)
    aux = batch.aux_hidden.clone()
    aux[3:6] += 5.0  # after the first anchor, in its sample; before the second's sample
    after = model.blocks(replace(batch, aux_hidden=aux), anchors, 3)
    assert torch.allclose(after, before, atol=1e-5)
    aux[2] += 5.0  # the first anchor's own state: its block reads it
    changed = model.blocks(replace(batch, aux_hidden=aux), anchors, 3)
    assert not torch.allclose(changed[0], before[0], atol=1e-3)
    assert torch.allclose(changed[1], before[1], atol=1e-5)


def test_slot_k_reports_what_eagle3s_step_k_minus_1_does() -> None:
    """Slot k at position i predicts the token i + k places on, counted where the
    teacher has a row there (the shifted loss mask) within the sample: the positions
    EAGLE-3's step k-1 counts, so `leading_correct` and the replay read both alike."""
    mask = [0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1]
    batch = _batch([7, 5], mask=mask)
    _, dflash = _model()(batch, ttt_steps=3)
    torch.manual_seed(0)
    eagle = Eagle3Draft(Eagle3Config(64, 4, 2, 16, 128, 96, 48))
    eagle.init_from_target(torch.randn(96, 64), torch.randn(96, 64), torch.ones(64),
                           build_draft_vocab({i: 1 for i in range(48)}, 96, 48))  # fmt: skip
    _, steps = eagle(batch, ttt_steps=3)
    assert len(dflash) == len(steps) == 3
    for slot, step in zip(dflash, steps, strict=True):
        assert slot.valid.tolist() == step.valid.tolist()
        assert torch.isfinite(slot.loss)
    assert leading_correct([s.correct for s in dflash], [s.valid for s in dflash]).shape == (12,)


def test_the_loss_trains_the_draft_and_never_the_targets_parts() -> None:
    model = _model().train()
    batch = _batch([10, 8])
    loss, _ = model(batch, ttt_steps=3)
    loss.backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0
    assert model.layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert model.embed_tokens.weight.grad is None and model.verifier_lm_head.weight.grad is None


def test_a_draft_learns_blocks_it_is_shown() -> None:
    """On one batch, a hundred steps take every slot's agreement with the teacher far
    above chance (1 in 48), the later slots too."""
    model = _model().train()
    batch = _batch([12, 12, 8])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(100):
        loss, stats = model(batch, ttt_steps=3)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    last, stats = model(batch, ttt_steps=3)
    assert last.item() < first / 3
    for slot in stats:
        assert slot.correct[slot.valid].float().mean() > 0.5


def test_training_draws_at_most_max_anchors_the_same_way_each_time() -> None:
    model = DFlashDraft(replace(CFG, max_anchors=5)).train()
    batch = _batch([10, 10])
    drawn = model.anchors(batch, 3)
    assert drawn.numel() == 5 and torch.equal(drawn, model.anchors(batch, 3))
    assert model.eval().anchors(batch, 3).numel() == 20  # held out: every position


def test_the_checkpoint_is_speculators_dflash_with_plain_rope_and_vllms_tensor_names(
    tmp_path: Path,
) -> None:
    config = checkpoint_config(CFG, [1, 2, 3], "/targets/t", ["Qwen3VLForConditionalGeneration"],
                               speculative_tokens=3, provenance={})  # fmt: skip
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3] and config["mask_token_id"] == 95
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2
    assert layer["rope_parameters"]["rope_type"] == "default"  # never the target's mRoPE
    assert "mrope_section" not in str(layer)
    assert draft_shape(config) == replace(CFG, max_anchors=CFG.max_anchors)
    names = set(draft_state(_model()))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t"} <= names
    assert "layers.1.self_attn.k_norm.weight" in names and "embed_tokens.weight" in names
    assert not any(n.startswith("verifier_") for n in names)


def test_parallel_drafts_warn_of_vllms_slots_for_an_m_rope_target_only() -> None:
    """vLLM 0.32 slots a parallel draft's keys by the target's positions: for an M-RoPE
    target the tokens of an image collide (measured in BENCHMARKS.md), so a DFlash or
    P-EAGLE training says so; EAGLE-3 (slotted by token index) and text targets are not
    concerned."""
    mrope = {"text_config": {"rope_parameters": {"mrope_section": [4, 6, 6]}}}
    plain = {"rope_parameters": {"rope_theta": 1e6}}
    assert FAMILIES["dflash"].serving_caveats(mrope) == [MROPE_SLOTS]
    assert FAMILIES["peagle"].serving_caveats(mrope) == [MROPE_SLOTS]
    assert FAMILIES["dflash"].serving_caveats(plain) == []
    assert FAMILIES["eagle3"].serving_caveats(mrope) == []
