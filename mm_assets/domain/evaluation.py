"""Held-out measurement of a trained draft in vLLM itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mm_assets.clients.vllm_server import (
    EngineOptions,
    ManagedVllmServer,
    speculative_decoding_args,
)
from mm_assets.clients.vllm_speculative import (
    SpecDecodeCounters,
    generate_greedy,
    spec_decode_counters,
)


def measure_in_vllm(
    target: str,
    draft_dir: Path,
    prompts: list[list[dict[str, Any]]],
    image_root: Path | None,
    log_path: Path,
    options: EngineOptions,
    speculative_tokens: int,
    max_tokens: int,
) -> tuple[SpecDecodeCounters, list[list[int]]]:
    """Serve the target with the draft, generate greedily, return the counters' change
    over the generations and the generated token ids."""
    args = speculative_decoding_args(draft_dir, speculative_tokens)
    with ManagedVllmServer(target, args, image_root, log_path, options) as url:
        before = spec_decode_counters(url)
        outputs = generate_greedy(url, prompts, max_tokens)
        after = spec_decode_counters(url)
    return after.minus(before), outputs
