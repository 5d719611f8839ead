"""Conformance with speculators 0.9.0 (the reference EAGLE-3 implementation): it loads our
checkpoint with its own loader and computes the same loss as our model on the same batch.

speculators is installed by `scripts/setup_env.sh` into `.venv/speculators-oracle`, outside
site-packages, and runs in a subprocess so its imports never touch this process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from mm_assets.domain.model.checkpoint import checkpoint_config
from mm_assets.domain.model.draft_vocab import build_draft_vocab
from mm_assets.domain.model.eagle3 import Eagle3Config, Eagle3Draft
from mm_assets.domain.model.families import FAMILIES
from mm_assets.domain.model.losses import LOSSES, LossRecipe, position_losses
from mm_assets.domain.model.training_data import SampleRef, load_batch
from mm_assets.services.target import load_target_head
from mm_assets.services.training import save_checkpoint
from mm_assets.services.warm_start import locate, warm_draft
from mm_assets.storage.layout import StorageLayout

ORACLE = Path(sys.prefix) / "speculators-oracle"
LOSS_TOLERANCE = 1e-5  # fp32; measured |diff| 4.8e-7 on a loss of 5.7

ORACLE_SCRIPT = r"""
import json, sys, torch
from safetensors.torch import load_file
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

ckpt, batch_path, steps, decay = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
cfg = Eagle3SpeculatorConfig.from_pretrained(ckpt)
cfg.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU backward
model = Eagle3DraftModel.from_pretrained(ckpt, config=cfg).eval()
b = load_file(batch_path)
with torch.no_grad():
    _, loss, metrics = model(
        hidden_states=b["aux_hidden"][None], input_ids=b["input_ids"][None],
        document_ids=b["segment"][None], loss_mask=b["loss_mask"][None],
        position_ids=b["position_ids"][None], verifier_last_hidden_states=b["last_hidden"][None],
        ttt_steps=steps, ttt_step_loss_decay=decay,
        loss_config=resolve_loss_config("kl_div", "eager"),
    )
state = {k: v for k, v in model.state_dict().items()}
print(json.dumps({
    "loss": float(loss),
    "t2d_sum": int(state["t2d"].sum()),
    "fc": state["fc.weight"].flatten()[:5].tolist(),
    "lm_head": state["lm_head.weight"].flatten()[:5].tolist(),
}))
"""

EAGLE3 = FAMILIES["eagle3"]


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> Path:
    """A tiny Llama target (speculators reads the verifier's embeddings, norm and head)."""
    path = tmp_path_factory.mktemp("verifier")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=96, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked teacher distributions
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "norms",
    [{}, {"norm_before_fc": True}, {"fc_norm": True, "norm_output": True}],
    ids=["eagle3", "norm_before_fc", "eagle3.1"],
)
def test_speculators_loads_our_checkpoint_and_computes_our_loss(
    verifier: Path, tmp_path: Path, norms: dict[str, bool]
) -> None:
    """With each of the norms vLLM and speculators read (speculators refuses
    norm_before_fc with fc_norm), trained a few steps so the norms are not ones."""
    if not (ORACLE / "speculators").is_dir():
        pytest.fail(f"speculators oracle missing at {ORACLE}; run `make setup`")
    target_config = json.loads((verifier / "config.json").read_text())
    cfg = dataclasses.replace(Eagle3Config.from_target(target_config, 48), **norms)
    torch.manual_seed(1)
    model = Eagle3Draft(cfg)
    head = load_target_head(verifier)
    vocab = build_draft_vocab({i: 200 - i for i in range(0, 90, 3)}, cfg.vocab_size, 48)
    model.init_from_target(head.embed_tokens, head.lm_head, head.final_norm, vocab)

    g = torch.Generator().manual_seed(2)
    n = 40
    blob = tmp_path / "sample.safetensors"
    ids = torch.randint(0, 96, (n,), generator=g)
    save_file(
        {"hidden_states": torch.randn(n, 4, 64, generator=g) * 2, "token_ids": ids}, str(blob)
    )
    mask = [0] * 10 + [1] * 25 + [0] * 5
    batch = load_batch([SampleRef("s", str(blob), ids.tolist(), mask)])

    # a few optimizer steps so the weights are not just the initialisation
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    fields = {
        k: getattr(batch, k)
        for k in ("input_ids", "aux_hidden", "last_hidden", "loss_mask", "position_ids", "segment")
    }
    for _ in range(3):
        loss, _ = model(batch, ttt_steps=3, loss=LossRecipe(decay=0.8))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        ours, _ = model(batch, ttt_steps=3, loss=LossRecipe(decay=0.8))

    ckpt = tmp_path / "draft"
    config = checkpoint_config(cfg, [1, 2, 3], str(verifier), ["LlamaForCausalLM"], 3, {})
    save_checkpoint(model, config, ckpt)
    batch_file = tmp_path / "batch.safetensors"
    # speculators takes layer L at every position; ours holds the supervised ones only,
    # and the others never reach the loss, so zeros stand in for them
    full = torch.zeros(len(batch.input_ids), 64)
    full[batch.loss_mask] = batch.last_hidden
    oracle_fields = {**fields, "last_hidden": full}
    save_file({k: v.contiguous() for k, v in oracle_fields.items()}, str(batch_file))

    env = {**os.environ, "PYTHONPATH": str(ORACLE)}
    proc = subprocess.run(
        [sys.executable, "-c", ORACLE_SCRIPT, str(ckpt), str(batch_file), "3", "0.8"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert theirs["t2d_sum"] == 48
    assert theirs["fc"] == pytest.approx(model.fc.weight.flatten()[:5].tolist(), abs=0)
    assert theirs["lm_head"] == pytest.approx(model.lm_head.weight.flatten()[:5].tolist(), abs=0)
    difference = abs(theirs["loss"] - float(ours))
    mine = float(ours)
    print(f"conformance: ours {mine:.8f} speculators {theirs['loss']:.8f} |diff| {difference:.2e}")
    assert float(ours) > 0.01  # a real loss, not a degenerate zero
    assert difference < LOSS_TOLERANCE


LOSSES_SCRIPT = r"""
import json, sys, torch
from safetensors.torch import load_file
from speculators.losses import resolve_loss_config

t = load_file(sys.argv[1])
out = {}
for name in json.loads(sys.argv[2]):
    ((fn, _),) = resolve_loss_config(name, "eager").values()
    out[name] = fn(t["logits"][None], t["teacher"][None])[0].tolist()
print(json.dumps(out))
"""


def test_each_loss_computes_what_speculators_computes(tmp_path: Path) -> None:
    """Per position, on peaked and flat distributions alike: speculators' eager losses
    (its `kl_div` is our `kl`) and ours give the same values."""
    if not (ORACLE / "speculators").is_dir():
        pytest.fail(f"speculators oracle missing at {ORACLE}; run `make setup`")
    g = torch.Generator().manual_seed(3)
    scale = torch.tensor([[0.3], [1.0], [4.0], [9.0]]).repeat(4, 1)
    logits, teacher = torch.randn(16, 48, generator=g) * scale, torch.randn(16, 48, generator=g)
    teacher = teacher * scale.flip(0)
    save_file({"logits": logits, "teacher": teacher}, str(tmp_path / "t.safetensors"))
    names = {name: "kl_div" if name == "kl" else name for name in LOSSES}
    env = {**os.environ, "PYTHONPATH": str(ORACLE)}
    proc = subprocess.run(
        [sys.executable, "-c", LOSSES_SCRIPT, str(tmp_path / "t.safetensors"),
         json.dumps(sorted(names.values()))],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    log_p = torch.log_softmax(teacher, dim=-1)
    for ours_name, their_name in names.items():
        ours = position_losses(log_p, logits, {ours_name: 1.0}).tolist()
        assert ours == pytest.approx(theirs[their_name], rel=1e-4, abs=1e-6), ours_name


RESAVE_SCRIPT = r"""
import json, sys, torch
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

source, out = sys.argv[1], sys.argv[2]
cfg = Eagle3SpeculatorConfig.from_pretrained(source)
model = Eagle3DraftModel.from_pretrained(source, config=cfg)
with torch.no_grad():
    model.fc.weight.add_(0.5)  # trained further, as a published draft would be
model.save_pretrained(out)
print(json.dumps({"fc": model.fc.weight.flatten()[:5].tolist()}))
"""


def test_a_draft_saved_by_speculators_starts_a_training_here(
    verifier: Path, tmp_path: Path
) -> None:
    """speculators' own `save_pretrained` writes the draft (as published drafts are
    written); `init_from` reads it back with its weights and vocabulary, and refuses it,
    saying why, for layer ids the states are not extracted with."""
    if not (ORACLE / "speculators").is_dir():
        pytest.fail(f"speculators oracle missing at {ORACLE}; run `make setup`")
    target_config = json.loads((verifier / "config.json").read_text())
    cfg = Eagle3Config.from_target(target_config, draft_vocab_size=48)
    torch.manual_seed(4)
    model = Eagle3Draft(cfg)
    head = load_target_head(verifier)
    vocab = build_draft_vocab({i: 200 - i for i in range(0, 90, 3)}, cfg.vocab_size, 48)
    model.init_from_target(head.embed_tokens, head.lm_head, head.final_norm, vocab)
    ours = tmp_path / "ours"
    config = checkpoint_config(cfg, [1, 2, 3], str(verifier), ["LlamaForCausalLM"], 3, {})
    save_checkpoint(model, config, ours)
    env = {**os.environ, "PYTHONPATH": str(ORACLE)}
    published = tmp_path / "published"
    proc = subprocess.run(
        [sys.executable, "-c", RESAVE_SCRIPT, str(ours), str(published)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])

    source = locate(str(published), StorageLayout(tmp_path))
    warm, warm_vocab = warm_draft(source, EAGLE3, cfg, [1, 2, 3, 4], head.embed_tokens)
    assert warm.fc.weight.flatten()[:5].tolist() == pytest.approx(theirs["fc"], abs=0)
    assert torch.equal(warm_vocab.selected, vocab.selected)
    assert torch.equal(
        warm.layers[0].self_attn.q_proj.weight, model.layers[0].self_attn.q_proj.weight
    )
    with pytest.raises(ValueError, match=r"auxiliary layer ids \[1, 2, 3\] ≠ \[2, 3, 4\]"):
        warm_draft(source, EAGLE3, cfg, [2, 3, 4, 5], head.embed_tokens)
