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
from mm_assets.clients.vllm_speculative import (
    SpecDecodeCounters,
    generate_greedy,
    spec_decode_counters,
)
from mm_assets.domain.reuse import inputs_key, load_record, save_record
from mm_assets.storage.tables import file_hash

MEASUREMENT_RECORD = "mm_assets_vllm_measurement.json"


@dataclass(frozen=True)
class Measurement:
    acceptance_length: float
    per_position: list[float]
    drafts: int
    reused: bool = False


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


def measured_acceptance(
    target: str,
    draft_dir: Path,
    prompts: list[list[dict[str, Any]]],
    image_root: Path | None,
    log_path: Path,
    options: EngineOptions,
    speculative_tokens: int,
    max_tokens: int,
    reuse: bool = True,
) -> Measurement:
    """Acceptance vLLM counts for this draft; with `reuse`, the figures recorded beside
    the draft when the same weights were measured on the same prompts and settings
    (starting a server costs about a minute on CPU and holds the accelerator)."""
    record = draft_dir / MEASUREMENT_RECORD
    key = inputs_key(
        file_hash(draft_dir / "model.safetensors"),
        target,
        prompts,
        asdict(options),
        speculative_tokens,
        max_tokens,
    )
    if reuse and (cached := load_record(record, key)):
        return Measurement(**cached, reused=True)
    counters, _ = measure_in_vllm(
        target, draft_dir, prompts, image_root, log_path, options, speculative_tokens, max_tokens
    )
    measured = Measurement(
        counters.acceptance_length, counters.per_position_rates, int(counters.drafts)
    )
    save_record(record, key, {k: v for k, v in asdict(measured).items() if k != "reused"})
    return measured
