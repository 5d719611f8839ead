"""What a lent GPU machine can tell that these CPU machines cannot: the trainer at a real
width on CUDA (tokens/s and peak memory, bf16 autocast as `trainer.py` runs it), and the
compact hidden-state codec at that width (encode and decode, where they run: on the CPU
of the extraction client and of the training loader).

    python -m bench.gpu_check                  # Qwen2.5-VL-7B's language model: H=3584
    python -m bench.gpu_check --hidden 64 ...  # a smoke run anywhere (tests run it so)

Needs torch and transformers only (no vLLM): a GPU box of this workplace has no network.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from mm_assets.domain.model import hidden_state_codec
from mm_assets.domain.model.draft_vocab import build_draft_vocab
from mm_assets.domain.model.eagle3 import Eagle3Config, Eagle3Draft
from mm_assets.domain.model.hidden_state_format import (
    ERROR_KEY,
    FinalLayer,
    StorageDtype,
    StorageFormat,
)
from mm_assets.domain.model.training_data import Batch

# Qwen2.5-VL-7B's text model (its config.json), the target the capacity table assumes
QWEN25_VL_7B = {
    "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
    "intermediate_size": 18944, "vocab_size": 152064, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}  # fmt: skip


def _draft(hidden: int, heads: int, vocab: int, draft_vocab: int, device: str) -> Eagle3Draft:
    target = {**QWEN25_VL_7B, "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": max(1, heads // 7), "intermediate_size": hidden * 5,
              "vocab_size": vocab}  # fmt: skip
    cfg = Eagle3Config.from_target(target, draft_vocab)
    model = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(0)
    head = torch.randn(vocab, hidden, generator=g) * hidden**-0.5
    frequencies = {i: vocab - i for i in range(0, vocab, max(1, vocab // draft_vocab))}
    vocab_map = build_draft_vocab(frequencies, vocab, cfg.draft_vocab_size)
    model.init_from_target(head, head, torch.ones(hidden), vocab_map)
    return model.to(device)


def _batch(tokens: int, hidden: int, vocab: int, device: str) -> Batch:
    """One packed batch of 4 rows, the last third of each supervised (a reply)."""
    g = torch.Generator().manual_seed(1)
    per_row = tokens // 4
    mask = torch.cat([torch.arange(per_row) >= per_row * 2 // 3] * 4)
    batch = {
        "input_ids": torch.randint(0, vocab, (per_row * 4,), generator=g),
        "aux_hidden": torch.randn(per_row * 4, 3 * hidden, generator=g),
        "last_hidden": torch.randn(int(mask.sum()), hidden, generator=g),
        "loss_mask": mask,
        "position_ids": torch.arange(per_row).repeat(4),
        "segment": torch.arange(4).repeat_interleave(per_row),
    }
    return Batch(**batch).to(torch.device(device))


def trainer_speed(
    hidden: int, heads: int, vocab: int, draft_vocab: int, tokens: int, steps: int, device: str
) -> dict[str, Any]:
    """AdamW steps on one batch, 3 TTT steps, after two warm-up steps."""
    model = _draft(hidden, heads, vocab, draft_vocab, device)
    batch = _batch(tokens, hidden, vocab, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    cuda = device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    elapsed = 0.0
    for step in range(steps + 2):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with autocast:
            loss, _ = model(batch, ttt_steps=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= 2:
            elapsed += time.perf_counter() - started
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "tokens_per_batch": batch.num_tokens,
        "tokens_per_s": round(batch.num_tokens * steps / elapsed),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "final_loss": round(float(loss.detach()), 4),
    }


def codec_speed(hidden: int, tokens: int, rounds: int) -> dict[str, Any]:
    """fp8_e4m3 / needed encode and decode of a bf16 row on one CPU thread (ms per row)."""
    torch.set_num_threads(1)
    states = torch.randn(tokens, 4, hidden, generator=torch.Generator().manual_seed(2))
    states = states.to(torch.bfloat16)
    ids, mask = torch.arange(tokens), [0, 0, 1] * (tokens // 3) + [1] * (tokens % 3)
    fmt = StorageFormat(StorageDtype.FP8_E4M3, FinalLayer.NEEDED)
    encode_s = decode_s = 0.0
    for _ in range(rounds):
        started = time.process_time()
        tensors, meta = hidden_state_codec.encode(states, ids, fmt, mask)
        encode_s += time.process_time() - started
        started = time.process_time()
        hidden_state_codec.decode(tensors, meta)
        decode_s += time.process_time() - started
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    return {
        "row": f"{tokens}x4x{hidden} bf16",
        "encode_ms": round(encode_s / rounds * 1000, 2),
        "decode_ms": round(decode_s / rounds * 1000, 2),
        "bytes_vs_bf16_layout": round(stored / (tokens * 4 * hidden * 2), 3),
        "max_rel_error": json.loads(meta[ERROR_KEY]),
    }


def run(
    hidden: int = 3584, heads: int = 28, vocab: int = 152064, draft_vocab: int = 32000,
    tokens: int = 8192, steps: int = 10, device: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return {
        "torch": torch.__version__,
        "trainer": trainer_speed(hidden, heads, vocab, draft_vocab, tokens, steps, device),
        "codec": codec_speed(hidden, 1000, rounds=3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check")
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per packed batch")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(json.dumps(run(args.hidden, args.heads, args.vocab, args.draft_vocab, args.tokens,
                         args.steps), indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
