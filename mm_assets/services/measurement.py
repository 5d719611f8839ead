"""Measuring a trained draft where it matters: vLLM serving the target with it.

Greedy generations from held-out prompts (images included) go to a server started with
the draft as its EAGLE-3 speculator; the change of its spec-decode counters over those
generations gives the acceptance length and per-position rates. The generated token ids
are kept with the figures, so a check of lossless decoding can compare them with the
target's own greedy output without serving the draft again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mm_assets.clients.vllm_generation import generate_greedy
from mm_assets.clients.vllm_metrics import spec_decode_counters
from mm_assets.clients.vllm_server import speculative_decoding_args
from mm_assets.common.hashing import file_sha256, json_sha256
from mm_assets.domain.model.hidden_states import text_config_facts
from mm_assets.domain.prep.conversations import first_prompt, to_vllm_messages
from mm_assets.domain.row_ids import sample_id_of
from mm_assets.services.engine import VllmEngine
from mm_assets.services.training import SpeculatorJob, SpeculatorOutcome
from mm_assets.storage import TableStore
from mm_assets.storage.records import load_record, save_record

MEASUREMENT_RECORD = "mm_assets_vllm_measurement.json"


@dataclass(frozen=True)
class Measurement:
    acceptance_length: float
    per_position: list[float]
    drafts: int
    prompts: list[list[dict[str, Any]]] = field(default_factory=list)
    """The chat prompts generated from (held-out, images as `file://` URLs)."""
    generations: list[list[int]] = field(default_factory=list)
    """Token ids vLLM generated with the draft, one list per prompt."""
    reused: bool = False


def held_out_prompts(
    tables: TableStore, partition: str, row_ids: set[str], limit: int
) -> list[list[dict[str, Any]]]:
    """Chat prompts (up to the first assistant turn) of held-out samples, images included."""
    sample_ids = {sample_id_of(row_id) for row_id in row_ids}
    prompts = []
    for row in tables.iter_rows("target_responses", partition, ["sample_id", "turns"]):
        if row["sample_id"] in sample_ids and (turns := first_prompt(json.loads(row["turns"]))):
            prompts.append(to_vllm_messages(turns))
            if len(prompts) >= limit:
                break
    return prompts


def measured_acceptance(
    target: str,
    draft_dir: Path,
    weights_sha256: str,
    prompts: list[list[dict[str, Any]]],
    engine: VllmEngine,
    image_root: Path | None,
    log_path: Path,
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
    options = asdict(engine.options)
    key = json_sha256([weights_sha256, target, prompts, options, speculative_tokens, max_tokens])
    if reuse and (cached := load_record(record, key)):
        return Measurement(**cached, reused=True)
    args = speculative_decoding_args(draft_dir, speculative_tokens)
    with engine.server(target, args, image_root, log_path) as url:
        before = spec_decode_counters(url)
        generations = generate_greedy(url, prompts, max_tokens)
        counters = spec_decode_counters(url).minus(before)
    measured = Measurement(
        counters.acceptance_length, counters.per_position_rates, int(counters.drafts),
        prompts, generations,
    )  # fmt: skip
    save_record(record, key, {k: v for k, v in asdict(measured).items() if k != "reused"})
    return measured


def measure_drafts(
    job: SpeculatorJob,
    outcome: SpeculatorOutcome,
    tables: TableStore,
    engine: VllmEngine,
    image_root: Path | None,
    log_path: Path,
    max_prompts: int,
    max_tokens: int,
    reuse: bool = True,
    untrained: bool = True,
) -> tuple[Measurement, Measurement | None]:
    """`measured_acceptance` of a training outcome on its held-out rows' prompts and,
    with `untrained`, of the same draft before training (`SpeculatorJob.untrained_dir`)
    on the same prompts: the baseline that shows what training bought."""
    prompts = held_out_prompts(
        tables, job.partition, {r.row_id for r in outcome.held_out}, max_prompts
    )
    engine = engine.for_target(text_config_facts(job.target_config))

    def measure(draft_dir: Path, weights_sha256: str | None) -> Measurement:
        weights_sha256 = weights_sha256 or file_sha256(draft_dir / "model.safetensors")
        return measured_acceptance(
            str(job.target_dir), draft_dir, weights_sha256, prompts, engine, image_root,
            log_path, job.settings.speculative_tokens, max_tokens, reuse,
        )  # fmt: skip

    trained = measure(outcome.checkpoint, outcome.weights_sha256)
    baseline = measure(job.untrained_dir, outcome.untrained_sha256) if untrained else None
    return trained, baseline
