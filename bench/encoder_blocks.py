"""The hidden-state encoder in cache-sized blocks against one pass over the whole row
(`BLOCK_ELEMENTS` set past the row's size), alternating in one run on one torch thread:
CPU ms per row and their ratio, for a real width (bf16 states, H=3584) and the demo's.

    python -m bench.encoder_blocks
"""

from __future__ import annotations

import json
import time

import torch

from mm_assets.domain.model import hidden_state_codec
from mm_assets.domain.model.hidden_state_format import FinalLayer, StorageDtype, StorageFormat

FORMATS = {
    "fp8_e4m3/needed": StorageFormat(StorageDtype.FP8_E4M3, FinalLayer.NEEDED),
    "bf16/all": StorageFormat(StorageDtype.BF16, FinalLayer.ALL),
}
SHAPES = {
    "1000x4x3584 bf16": (1000, 3584, torch.bfloat16),
    "700x4x64 fp32": (700, 64, torch.float32),
}


def _cpu_ms(states: torch.Tensor, fmt: StorageFormat, block_elements: int, rows: int) -> float:
    hidden_state_codec.BLOCK_ELEMENTS = block_elements
    ids, mask = torch.arange(states.shape[0]), [0, 1] * (states.shape[0] // 2)
    started = time.process_time()
    for _ in range(rows):
        hidden_state_codec.encode(states, ids, fmt, mask)
    return (time.process_time() - started) / rows * 1000


def run(rounds: int = 5, rows: int = 4) -> dict:
    torch.set_num_threads(1)
    blocked = hidden_state_codec.BLOCK_ELEMENTS
    results: dict[str, dict] = {}
    for shape, (tokens, hidden, dtype) in SHAPES.items():
        states = torch.randn(tokens, 4, hidden, generator=torch.Generator().manual_seed(0))
        states = states.to(dtype)
        for name, fmt in FORMATS.items():
            ms: dict[str, list[float]] = {"one_pass": [], "blocks": []}
            for _ in range(rounds):  # alternating: drift in the machine's speed hits both
                ms["one_pass"].append(_cpu_ms(states, fmt, 1 << 40, rows))
                ms["blocks"].append(_cpu_ms(states, fmt, blocked, rows))
            median = {k: sorted(v)[len(v) // 2] for k, v in ms.items()}
            results[f"{shape} {name}"] = {
                "one_pass_ms": round(median["one_pass"], 2),
                "blocks_ms": round(median["blocks"], 2),
                "blocks_vs_one_pass": round(median["blocks"] / median["one_pass"], 3),
            }
    hidden_state_codec.BLOCK_ELEMENTS = blocked
    return {"rounds": rounds, "rows_per_round": rows, "results": results}


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
