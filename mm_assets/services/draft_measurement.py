"""A draft of several datasets measured per source: vLLM's acceptance on each source's
held-out prompts (one server, counters differenced per source) beside the offline
estimate over the same replies, overall, and — to show what the mix buys — each
source's own draft (its `trained_speculator` checkpoint, when there is one) served on
the same prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mm_assets.common.hashing import file_sha256
from mm_assets.domain.model.acceptance import AcceptanceSummary, summarize
from mm_assets.domain.model.hidden_states import text_config_facts
from mm_assets.services.engine import VllmEngine
from mm_assets.services.measurement import (
    Measurement,
    measured_groups,
    same_as_target,
    source_replies,
)
from mm_assets.services.training import SpeculatorJob, SpeculatorOutcome
from mm_assets.storage import TableStore

OVERALL = "overall"


@dataclass(frozen=True)
class SourceFigures:
    """One draft on one source's held-out prompts (or all of them: `OVERALL`): what vLLM
    measured, beside the offline estimate and the lossless count for those prompts."""

    measured: Measurement
    estimate: float | None = None
    same_as_target: int | None = None


def combined(measurements: list[Measurement]) -> Measurement:
    """Several sources' measurements as one: counts summed (acceptance weighted by
    drafts), prompts and generations in source order."""
    drafts = sum(m.drafts for m in measurements)
    accepted = sum((m.acceptance_length - 1) * m.drafts for m in measurements)
    width = max((len(m.per_position) for m in measurements), default=0)
    per_position = [
        sum(m.per_position[k] * m.drafts for m in measurements if k < len(m.per_position))
        / max(drafts, 1)
        for k in range(width)
    ]
    return Measurement(
        1 + accepted / max(drafts, 1), per_position, drafts,
        [p for m in measurements for p in m.prompts],
        [g for m in measurements for g in m.generations],
        reused=all(m.reused for m in measurements),
    )  # fmt: skip


@dataclass(frozen=True)
class DraftBySource:
    """The draft's figures per source (and overall), and other drafts' on the same
    prompts: draft name -> source -> figures."""

    trained: dict[str, SourceFigures]
    others: dict[str, dict[str, SourceFigures]]


def measure_by_source(
    job: SpeculatorJob,
    outcome: SpeculatorOutcome,
    sources: list[str],
    tables: TableStore,
    engine: VllmEngine,
    image_root: Path | None,
    log_path: Path,
    max_prompts: int,
    max_tokens: int,
    reuse: bool = True,
    others: dict[str, Path] | None = None,
) -> DraftBySource:
    """The draft on each source's held-out prompts; `others`: more drafts (name ->
    checkpoint directory) served on the same prompts, one server each."""
    replies = source_replies(tables, outcome.result.held_out_replies, sources, max_prompts)
    groups = {source: [r.prompt for r in rs] for source, rs in replies.items()}
    engine = engine.for_target(text_config_facts(job.target_config))

    def measure(draft_dir: Path, weights: str, record: str) -> dict[str, Measurement]:
        return measured_groups(
            str(job.target_dir), draft_dir, weights, groups, engine, image_root, log_path,
            job.settings.speculative_tokens, max_tokens, reuse, record,
        )  # fmt: skip

    def estimate(source: str) -> AcceptanceSummary:
        replayed = outcome.result.held_out_replies
        walks = [replayed[r.row_id][r.reply] for r in replies[source]]
        return summarize(walks, job.settings.ttt_steps, max_tokens)

    assert outcome.weights_sha256 is not None
    measured = measure(outcome.checkpoint, outcome.weights_sha256, "mm_assets_vllm_by_source.json")
    trained = {
        s: SourceFigures(
            m, estimate(s).acceptance_length, same_as_target(replies[s], m.generations)
        )
        for s, m in measured.items()
    }
    trained[OVERALL] = SourceFigures(combined(list(measured.values())))
    compared = {}
    for name, directory in (others or {}).items():
        record = f"mm_assets_vllm_on_{job.partition}.json"  # its own record stays its own
        theirs = measure(directory, file_sha256(directory / "model.safetensors"), record)
        compared[name] = {s: SourceFigures(m) for s, m in theirs.items()}
        compared[name][OVERALL] = SourceFigures(combined(list(theirs.values())))
    return DraftBySource(trained, compared)
