"""A draft of several datasets measured per source: vLLM's acceptance on each source's
held-out prompts (one server, counters differenced per source) beside the offline
estimate over the same replies, overall, and — to show what the mix buys — each
source's own draft (its `trained_speculator` checkpoint, when there is one) served on
the same prompts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from mm_assets.common.hashing import file_sha256
from mm_assets.domain.model.acceptance import AcceptanceSummary, summarize
from mm_assets.domain.model.draft_set import SEPARATOR, source_of
from mm_assets.domain.model.hidden_states import text_config_facts
from mm_assets.services.engine import VllmEngine
from mm_assets.services.measurement import (
    HeldOutReply,
    Measurement,
    held_out_replies,
    measured_groups,
    same_as_target,
)
from mm_assets.services.training import SpeculatorJob, SpeculatorOutcome
from mm_assets.storage import TableStore

OVERALL = "overall"


@dataclass(frozen=True)
class SourceFigures:
    """One draft on one source's held-out prompts (or all of them: `OVERALL`)."""

    acceptance_length: float
    per_position: list[float]
    drafts: int
    prompts: int
    estimate: float | None = None
    same_as_target: int | None = None
    reused: bool = False


def combined(figures: list[SourceFigures]) -> SourceFigures:
    """Several sources' figures as one: counts summed (acceptance weighted by drafts)."""
    drafts = sum(f.drafts for f in figures)
    accepted = sum((f.acceptance_length - 1) * f.drafts for f in figures)
    width = max((len(f.per_position) for f in figures), default=0)
    per_position = [
        sum(f.per_position[k] * f.drafts for f in figures if k < len(f.per_position))
        / max(drafts, 1)
        for k in range(width)
    ]
    return SourceFigures(
        1 + accepted / max(drafts, 1), per_position, drafts, sum(f.prompts for f in figures),
        reused=all(f.reused for f in figures),
    )  # fmt: skip


@dataclass(frozen=True)
class DraftBySource:
    """The draft's figures per source (and overall), and other drafts' on the same
    prompts: draft name -> source -> figures."""

    trained: dict[str, SourceFigures]
    others: dict[str, dict[str, SourceFigures]]


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
        s: _figures(m, estimate(s).acceptance_length, same_as_target(replies[s], m.generations))
        for s, m in measured.items()
    }
    trained[OVERALL] = combined(list(trained.values()))
    compared = {}
    for name, directory in (others or {}).items():
        record = f"mm_assets_vllm_on_{job.partition}.json"  # its own record stays its own
        theirs = measure(directory, file_sha256(directory / "model.safetensors"), record)
        compared[name] = {s: _figures(m) for s, m in theirs.items()}
        compared[name][OVERALL] = combined(list(compared[name].values()))
    return DraftBySource(trained, compared)


def _figures(
    measured: Measurement, estimate: float | None = None, same: int | None = None
) -> SourceFigures:
    return SourceFigures(
        measured.acceptance_length, measured.per_position, measured.drafts,
        len(measured.prompts), estimate, same, measured.reused,
    )  # fmt: skip
