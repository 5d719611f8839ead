"""Measuring a trained draft where it matters: vLLM serving the target with it.

Greedy generations from held-out prompts (images included) go to a server started with
the draft as its EAGLE-3 speculator; the change of its spec-decode counters over those
generations gives the acceptance length and per-position rates. The generated token ids
are kept with the figures, so a check of lossless decoding can compare them with the
target's own greedy output without serving the draft again.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mm_assets.clients.vllm_generation import generate_greedy
from mm_assets.clients.vllm_metrics import spec_decode_counters
from mm_assets.clients.vllm_server import speculative_decoding_args
from mm_assets.common.crashpoints import crash_point
from mm_assets.common.hashing import file_sha256, json_sha256
from mm_assets.domain.model.acceptance import AcceptanceSummary, summarize
from mm_assets.domain.model.draft_set import SEPARATOR, source_of
from mm_assets.domain.model.hidden_states import text_config_facts
from mm_assets.domain.prep.conversations import reply_prompts, to_vllm_messages
from mm_assets.domain.row_ids import sample_id_of, turn_index_of
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


@dataclass(frozen=True)
class HeldOutReply:
    row_id: str
    reply: int
    """Index among the row's supervised replies (`TrainResult.held_out_replies`)."""
    prompt: list[dict[str, Any]]
    target_ids: list[int] | None
    """What the target generated for this prompt without a draft (regenerated replies)."""


def held_out_replies(
    tables: TableStore, partition: str, replayed: dict[str, list[list[int]]], limit: int
) -> list[HeldOutReply]:
    """Up to `limit` replies of held-out rows (those replayed offline, in their order),
    each with the chat prompt it answers, images included: the same replies the offline
    estimate covers, so the two compare like for like."""
    wanted = {sample_id_of(row_id) for row_id in replayed}
    columns = ["sample_id", "turns", "reply_turns", "reply_token_ids"]
    conversations = {
        row["sample_id"]: row
        for row in tables.iter_rows("target_responses", partition, columns)
        if row["sample_id"] in wanted
    }
    replies = []
    for row_id, walks in replayed.items():
        row = conversations.get(sample_id_of(row_id))
        if row is None:
            continue
        generated = dict(zip(row["reply_turns"] or [], row["reply_token_ids"] or [], strict=True))
        prompts = reply_prompts(json.loads(row["turns"]), turn_index_of(row_id))
        for reply, (turn, prompt) in list(enumerate(prompts))[: len(walks)]:
            if prompt and len(replies) < limit:
                messages = to_vllm_messages(prompt)
                replies.append(HeldOutReply(row_id, reply, messages, generated.get(turn)))
    return replies


def source_replies(
    tables: TableStore, replayed: dict[str, list[list[int]]], sources: list[str], limit: int
) -> dict[str, list[HeldOutReply]]:
    """Each source's held-out replies (up to `limit`), with the draft's row ids."""
    out = {}
    for source in sources:
        mine = {source_of(r)[1]: w for r, w in replayed.items() if source_of(r)[0] == source}
        replies = held_out_replies(tables, source, mine, limit)
        out[source] = [
            dataclasses.replace(r, row_id=f"{source}{SEPARATOR}{r.row_id}") for r in replies
        ]
    return out


def same_as_target(replies: list[HeldOutReply], generations: list[list[int]]) -> int | None:
    """How many generations with the draft equal the target's own reply to the prompt
    (over their common length: the two may stop at different `max_tokens`): lossless
    speculative decoding, checked without serving the target again. None when the
    replies are the dataset's, not the target's."""
    pairs = [(r.target_ids, g) for r, g in zip(replies, generations, strict=True)]
    if any(target is None for target, _ in pairs):
        return None
    return sum(target[: len(g)] == g[: len(target)] for target, g in pairs)


def measured_groups(
    target: str,
    draft_dir: Path,
    weights_sha256: str,
    groups: dict[str, list[list[dict[str, Any]]]],
    engine: VllmEngine,
    image_root: Path | None,
    log_path: Path,
    speculative_tokens: int,
    max_tokens: int,
    reuse: bool = True,
    record_name: str = MEASUREMENT_RECORD,
) -> dict[str, Measurement]:
    """Acceptance vLLM counts for each group of prompts in turn (its counters differenced
    per group) on one server of the target with this draft. With `reuse`, the figures
    recorded beside the draft (`record_name`) when the same weights (`weights_sha256`)
    were measured on the same prompts and settings: starting a server costs about a
    minute on CPU and holds the accelerator."""
    record = draft_dir / record_name
    options = engine.options.model_dump()
    key = json_sha256([weights_sha256, target, groups, options, speculative_tokens, max_tokens])
    if reuse and (cached := load_record(record, key)):
        return {name: Measurement(**fields, reused=True) for name, fields in cached.items()}
    args = speculative_decoding_args(draft_dir, speculative_tokens)
    measured = {}
    with engine.server(target, args, image_root, log_path) as url:
        crash_point("measurement")
        for name, prompts in groups.items():
            before = spec_decode_counters(url)
            generations = generate_greedy(url, prompts, max_tokens)
            counters = spec_decode_counters(url).minus(before)
            measured[name] = Measurement(
                counters.acceptance_length, counters.per_position_rates, int(counters.drafts),
                prompts, generations,
            )  # fmt: skip
    fields = {
        name: {k: v for k, v in asdict(m).items() if k != "reused"} for name, m in measured.items()
    }
    save_record(record, key, fields)
    return measured


@dataclass(frozen=True)
class DraftMeasurements:
    """vLLM's figures for the trained draft (and the untrained baseline), each beside the
    offline estimate replayed over exactly the replies vLLM generated."""

    trained: Measurement
    trained_estimate: AcceptanceSummary
    untrained: Measurement | None
    untrained_estimate: AcceptanceSummary
    same_as_target: int | None
    """Generations with the trained draft equal to the target's own (`same_as_target`)."""


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
) -> DraftMeasurements:
    """What vLLM measures (`measured_groups`) of a training outcome on its held-out
    replies' prompts and, with `untrained`, of the same draft before training
    (`SpeculatorJob.untrained_dir`) on the same prompts: the baseline that shows what
    training bought."""
    replayed = outcome.result.held_out_replies
    replies = source_replies(tables, replayed, [job.partition], max_prompts)[job.partition]
    prompts = [reply.prompt for reply in replies]
    engine = engine.for_target(text_config_facts(job.target_config))

    def measure(draft_dir: Path, weights_sha256: str | None) -> Measurement:
        weights_sha256 = weights_sha256 or file_sha256(draft_dir / "model.safetensors")
        return measured_groups(
            str(job.target_dir), draft_dir, weights_sha256, {"": prompts}, engine, image_root,
            log_path, job.settings.speculative_tokens, max_tokens, reuse,
        )[""]  # fmt: skip

    def estimate(replayed: dict[str, list[list[int]]]) -> AcceptanceSummary:
        walks = [replayed[reply.row_id][reply.reply] for reply in replies]
        return summarize(walks, job.settings.ttt_steps, max_tokens)

    trained = measure(outcome.checkpoint, outcome.weights_sha256)
    return DraftMeasurements(
        trained,
        estimate(outcome.result.held_out_replies),
        measure(job.untrained_dir, outcome.untrained_sha256) if untrained else None,
        estimate(outcome.untrained_replies),
        same_as_target(replies, trained.generations),
    )
