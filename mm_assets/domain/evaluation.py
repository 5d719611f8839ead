"""Held-out measurement of a trained draft in vLLM itself."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mm_assets.clients.vllm_server import (
    EngineOptions,
    ManagedVllmServer,
    speculative_decoding_args,
)
from mm_assets.clients.vllm_speculative import generate_greedy, spec_decode_counters
from mm_assets.domain.reuse import inputs_key, load_record, save_record

MEASUREMENT_RECORD = "mm_assets_vllm_measurement.json"


@dataclass(frozen=True)
class Measurement:
    acceptance_length: float
    per_position: list[float]
    drafts: int
    reused: bool = False


def measured_acceptance(
    target: str,
    draft_dir: Path,
    weights_sha256: str,
    prompts: list[list[dict[str, Any]]],
    image_root: Path | None,
    log_path: Path,
    options: EngineOptions,
    speculative_tokens: int,
    max_tokens: int,
    reuse: bool = True,
) -> Measurement:
    """Acceptance vLLM counts while serving the target with this draft and generating
    greedily from `prompts`. With `reuse`, the figures recorded beside the draft when the
    same weights (`weights_sha256`, of its model.safetensors) were measured on the same
    prompts and settings: starting a server costs about a minute on CPU and holds the
    accelerator."""
    record = draft_dir / MEASUREMENT_RECORD
    key = inputs_key(
        weights_sha256,
        target,
        prompts,
        asdict(options),
        speculative_tokens,
        max_tokens,
    )
    if reuse and (cached := load_record(record, key)):
        return Measurement(**cached, reused=True)
    args = speculative_decoding_args(draft_dir, speculative_tokens)
    with ManagedVllmServer(target, args, image_root, log_path, options) as url:
        before = spec_decode_counters(url)
        generate_greedy(url, prompts, max_tokens)
        counters = spec_decode_counters(url).minus(before)
    measured = Measurement(
        counters.acceptance_length, counters.per_position_rates, int(counters.drafts)
    )
    save_record(record, key, {k: v for k, v in asdict(measured).items() if k != "reused"})
    return measured
