"""Training throughput: our EAGLE-3 draft vs speculators 0.9.0's, same loop, same batches;
and our DFlash block draft and P-EAGLE (parallel EAGLE-3) on the same batches (the cost of
the other families).

CPU, fp32, sdpa attention, eager KL loss, AdamW; a 256-wide draft (4 heads of 64) over a
2,048-token target vocabulary with a 1,024-token draft vocabulary, 3 TTT steps (DFlash:
blocks of 3 masked slots, 2 layers, its default 1,024 anchors per batch), packed batches
of 4 × 512 tokens. Both EAGLE-3 models start from the same checkpoint. Each side runs in
its own process, alternating twice; the first epoch warms up and the second is timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ORACLE = Path(sys.prefix) / "speculators-oracle"
BATCHES, SAMPLES, LENGTH, STEPS = 6, 4, 512, 3


def _prepare(workdir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from mm_assets.domain.model.checkpoint import checkpoint_config
    from mm_assets.domain.model.draft_vocab import build_draft_vocab
    from mm_assets.domain.model.eagle3 import Eagle3Config, Eagle3Draft
    from mm_assets.services.target import load_target_head
    from mm_assets.services.training import save_checkpoint

    torch.manual_seed(0)
    target = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=64, vocab_size=2048, max_position_embeddings=1024,
    )  # fmt: skip
    LlamaForCausalLM(target).save_pretrained(workdir / "verifier")
    cfg = Eagle3Config.from_target(target.to_dict(), 1024)
    model = Eagle3Draft(cfg)
    head = load_target_head(workdir / "verifier")
    vocab = build_draft_vocab({i: 4096 - i for i in range(0, 2048, 2)}, 2048, 1024)
    model.init_from_target(head.embed_tokens, head.lm_head, head.final_norm, vocab)
    config = checkpoint_config(
        cfg, [1, 2, 3], str(workdir / "verifier"), ["LlamaForCausalLM"], 3, {}
    )
    save_checkpoint(model, config, workdir / "draft")
    g = torch.Generator().manual_seed(1)
    n = SAMPLES * LENGTH
    for b in range(BATCHES):
        save_file(
            {
                "input_ids": torch.randint(0, 2048, (n,), generator=g),
                "aux_hidden": torch.randn(n, 3 * 256, generator=g),
                "last_hidden": torch.randn(n, 256, generator=g),
                "loss_mask": torch.ones(n, dtype=torch.bool),
                "position_ids": torch.arange(1, LENGTH + 1).repeat(SAMPLES),
                "segment": torch.arange(SAMPLES).repeat_interleave(LENGTH),
            },
            str(workdir / f"batch{b}.safetensors"),
        )


def _run(side: str, workdir: Path) -> float:
    """Inside a child process: train two epochs, return tokens/s of the second."""
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(0)
    batches = [load_file(str(workdir / f"batch{b}.safetensors")) for b in range(BATCHES)]
    if side in ("ours", "peagle"):
        from dataclasses import replace

        from mm_assets.domain.model.eagle3 import Eagle3Draft
        from mm_assets.domain.model.families import draft_from
        from mm_assets.domain.model.training_data import Batch
        from mm_assets.services.target import load_target_head
        from mm_assets.storage.checkpoints import read_checkpoint

        model = draft_from(*read_checkpoint(workdir / "draft"), str(workdir / "draft"))
        if side == "peagle":  # the same draft with parallel slots (P-EAGLE)
            parallel = Eagle3Draft(replace(model.cfg, mask_token_id=2047))
            parallel.load_state_dict(model.state_dict(), strict=False)
            model = parallel
        head = load_target_head(workdir / "verifier")
        with torch.no_grad():
            model.verifier_norm.weight.copy_(head.final_norm)
            model.verifier_lm_head.weight.copy_(head.lm_head[model.t2d])

        def step(b):
            loss, _ = model(Batch(**b), ttt_steps=STEPS)
            return loss
    elif side == "dflash":
        from mm_assets.domain.model.dflash import DFlashDraft, dflash_config
        from mm_assets.domain.model.draft_vocab import build_draft_vocab
        from mm_assets.domain.model.training_data import Batch
        from mm_assets.services.target import load_target_head

        target = json.loads((workdir / "verifier" / "config.json").read_text())
        model = DFlashDraft(dflash_config(target, 1024, mask_token_id=2047, num_layers=2))
        head = load_target_head(workdir / "verifier")
        vocab = build_draft_vocab({i: 4096 - i for i in range(0, 2048, 2)}, 2048, 1024)
        model.init_from_target(head.embed_tokens, head.lm_head, head.final_norm, vocab)

        def step(b):
            loss, _ = model(Batch(**b), ttt_steps=STEPS)
            return loss
    else:
        from speculators.losses import resolve_loss_config
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

        cfg = Eagle3SpeculatorConfig.from_pretrained(str(workdir / "draft"))
        cfg.transformer_layer_config._attn_implementation = "sdpa"
        model = Eagle3DraftModel.from_pretrained(str(workdir / "draft"), config=cfg)
        loss_config = resolve_loss_config("kl_div", "eager")

        def step(b):
            _, loss, _ = model(
                hidden_states=b["aux_hidden"][None], input_ids=b["input_ids"][None],
                document_ids=b["segment"][None], loss_mask=b["loss_mask"][None],
                position_ids=b["position_ids"][None],
                verifier_last_hidden_states=b["last_hidden"][None],
                ttt_steps=STEPS, loss_config=loss_config,
            )  # fmt: skip
            return loss

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    elapsed = 0.0
    for _epoch in range(2):  # the first epoch warms up
        started = time.perf_counter()
        for b in batches:
            loss = step(b)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        elapsed = time.perf_counter() - started
    return BATCHES * SAMPLES * LENGTH / elapsed


def run(workdir: Path) -> dict:
    _prepare(workdir)
    results: dict[str, list[float]] = {"ours": [], "speculators": [], "dflash": [], "peagle": []}
    for _ in range(2):
        for side in results:
            env = dict(os.environ)
            if side == "speculators":
                env["PYTHONPATH"] = str(ORACLE)
            out = subprocess.run(
                [sys.executable, "-m", "bench.train_speed", "--side", side, str(workdir)],
                capture_output=True, text=True, check=True, env=env,
                cwd=Path(__file__).resolve().parents[1],
            ).stdout  # fmt: skip
            results[side].append(float(out.strip().splitlines()[-1]))
    ours, theirs = sum(results["ours"]), sum(results["speculators"])
    return {
        "ours_tokens_per_s": [round(v) for v in results["ours"]],
        "speculators_tokens_per_s": [round(v) for v in results["speculators"]],
        "ratio": ours / theirs,
        "dflash_tokens_per_s": [round(v) for v in results["dflash"]],
        "dflash_vs_ours": sum(results["dflash"]) / ours,
        "peagle_tokens_per_s": [round(v) for v in results["peagle"]],
        "peagle_vs_ours": sum(results["peagle"]) / ours,
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--side":
        print(_run(sys.argv[2], Path(sys.argv[3])))
        return
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(Path(tmp)), indent=2))


if __name__ == "__main__":
    main()
