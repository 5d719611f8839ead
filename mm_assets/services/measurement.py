"""Measuring a trained draft where it matters: vLLM serving the target with it.

Every draft (a dataset's, or several datasets') is measured the same way: greedy
generations from each source's held-out prompts (images included) go to a server started
with the draft as its EAGLE-3 speculator; the change of its spec-decode counters over
each source's generations gives the acceptance length and per-position rates, beside the
offline estimate replayed over exactly those replies. The untrained draft (the baseline)
and other drafts (each source's own, for a draft of several) are served on the same
prompts where asked. The generated token ids are kept with the figures, so a check of
lossless decoding can compare them with the target's own greedy output without serving
the draft again.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from mm_assets.clients.vllm_generation import generate_greedy_replies
from mm_assets.clients.vllm_metrics import counters_after, server_counters
from mm_assets.clients.vllm_server import death_explained
from mm_assets.common.crashpoints import crash_point
from mm_assets.common.hashing import file_sha256, json_sha256
from mm_assets.domain.model.acceptance import (
    OVERALL,
    Acceptance,
    WithAcceptance,
    combine,
    summarize,
)
from mm_assets.domain.model.benchmark import Generation, lossless_count
from mm_assets.domain.model.draft_set import SEPARATOR, source_of
from mm_assets.domain.model.families import family_of
from mm_assets.domain.model.intervals import Interval, ratio_interval
from mm_assets.domain.model.settings import MeasurementSettings
from mm_assets.domain.prep.conversations import reply_prompts, to_vllm_messages
from mm_assets.domain.row_ids import sample_id_of, turn_index_of
from mm_assets.services.engine import DraftUnderTest, Serving
from mm_assets.services.result_tables import write_results
from mm_assets.services.training import SpeculatorJob, SpeculatorOutcome
from mm_assets.storage import TableStore
from mm_assets.storage.checkpoints import read_checkpoint_config
from mm_assets.storage.layout import StorageLayout
from mm_assets.storage.layout import weights as weights_file
from mm_assets.storage.records import load_record, save_record

MEASUREMENT_VERSION = "3"  # 3: each prompt's own counts recorded
TABLE = "draft_measurements"


@dataclass(frozen=True)
class Measurement(WithAcceptance):
    acceptance: Acceptance
    prompts: list[list[dict[str, Any]]] = field(default_factory=list)
    """The chat prompts generated from (held-out, images as `file://` URLs)."""
    generations: list[list[int]] = field(default_factory=list)
    """Token ids vLLM generated with the draft, one list per prompt."""
    per_prompt: list[tuple[int, int]] = field(default_factory=list)
    """(drafts, accepted) of each prompt, as vLLM's reply gave them; empty from a server
    that does not say (an external fleet), whose figure is its counters' only."""
    reused: bool = False
    sources: list[str] = field(default_factory=list)
    """Each prompt's source, in a measurement of several (`combined`)."""

    @cached_property
    def interval(self) -> Interval | None:
        """The acceptance length with its 95% bootstrap interval over the prompts: over
        several sources, resampled within each (each source's share is the draft's
        design, not a draw)."""
        if not self.per_prompt:
            return None
        drafts, accepted = zip(*self.per_prompt, strict=True)
        return ratio_interval(accepted, drafts, offset=1.0, strata=self.sources or None)

    @classmethod
    def combined(cls, parts: dict[str, Measurement]) -> Measurement:
        """Several sources' measurements as one: counts summed, prompts and generations
        in source order."""
        measured = list(parts.values())
        every = all(m.per_prompt for m in measured)
        return cls(
            combine(m.acceptance for m in measured),
            [p for m in measured for p in m.prompts],
            [g for m in measured for g in m.generations],
            [c for m in measured for c in m.per_prompt] if every else [],
            reused=all(m.reused for m in measured),
            sources=[s for s, m in parts.items() for _ in m.per_prompt] if every else [],
        )

    @classmethod
    def from_record(cls, fields: dict[str, Any]) -> Measurement:
        acceptance = Acceptance.from_record(fields["acceptance"])
        per_prompt = [(d, a) for d, a in fields["per_prompt"]]
        return cls(acceptance, fields["prompts"], fields["generations"], per_prompt, True)


@dataclass(frozen=True)
class HeldOutReply:
    row_id: str
    reply: int
    """Index among the row's supervised replies (`TrainResult.held_out_replies`)."""
    prompt: list[dict[str, Any]]
    target: Generation | None
    """What the target generated for this prompt without a draft (regenerated replies)."""


def held_out_replies(
    tables: TableStore, partition: str, replayed: dict[str, list[list[int]]], limit: int
) -> list[HeldOutReply]:
    """Up to `limit` replies of held-out rows (those replayed offline, in their order),
    each with the chat prompt it answers, images included: the same replies the offline
    estimate covers, so the two compare like for like."""
    wanted = {sample_id_of(row_id) for row_id in replayed}
    columns = ["sample_id", "turns", "reply_turns", "reply_token_ids", "finish_reasons"]
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
        generated = {
            turn: Generation(ids, reason == "length")
            for turn, ids, reason in zip(
                row["reply_turns"] or [],
                row["reply_token_ids"] or [],
                row["finish_reasons"] or [],
                strict=True,
            )
        }
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


def same_as_target(
    replies: list[HeldOutReply], generations: list[list[int]], max_tokens: int
) -> int | None:
    """How many generations with the draft are the target's own reply to the prompt
    (`same_generation`): lossless speculative decoding, checked without serving the
    target again. None when the replies are the dataset's, not the target's."""
    pairs = []
    for reply, generated in zip(replies, generations, strict=True):
        if reply.target is None:
            return None
        pairs.append((Generation.limited(generated, max_tokens), reply.target))
    return lossless_count(pairs)


def measurement_record(storage_root: Path, prompts_of: str, measured: str) -> Path:
    """Where the figures of `measured` (a draft's name, `<name>.untrained` for its
    baseline) on the held-out prompts of the draft `prompts_of` are recorded."""
    return StorageLayout(storage_root).measurements(prompts_of) / f"{measured}.json"


def measured_groups(
    serving: Serving,
    draft: DraftUnderTest,
    groups: dict[str, list[list[dict[str, Any]]]],
    limits: tuple[int, int],
    record: Path,
    reuse: bool = True,
) -> dict[str, Measurement]:
    """Acceptance vLLM counts for each group of prompts in turn (its counters differenced
    per group) on one server of the target with this draft. With `reuse`, the figures
    in `record` when the same weights were measured on the same prompts and settings:
    starting a server costs about a minute on CPU and holds the accelerator."""
    options = serving.engine.options.model_dump()
    served = [draft.weights_sha256, str(serving.target_dir), draft.speculative_tokens]
    max_tokens, concurrency = limits  # per reply; requests in flight
    key = json_sha256([MEASUREMENT_VERSION, *served, groups, options, max_tokens, concurrency])
    if reuse and (cached := load_record(record, key)):
        return {name: Measurement.from_record(fields) for name, fields in cached.items()}
    measured = {}
    server = serving.server(draft.serve_args())
    with server as url, death_explained(server, f"measuring {draft.dir}"):
        crash_point("measurement")
        for name, prompts in groups.items():
            before = server_counters(url)
            replies = generate_greedy_replies(url, server.access, prompts, max_tokens, concurrency)
            counters = counters_after(url, before, len(prompts)).minus(before).spec_decode
            acceptance = Acceptance.from_counts(
                counters.drafts, counters.accepted, counters.accepted_per_position
            )
            generations = [r.token_ids for r in replies]
            per_prompt = [(r.metrics.verifications, r.metrics.accepted) for r in replies]
            if any(r.metrics.accepted_per_position is None for r in replies):
                per_prompt = []  # the server does not give each reply's counts
            measured[name] = Measurement(acceptance, prompts, generations, per_prompt)
    fields = {
        name: {k: v for k, v in asdict(m).items() if k not in ("reused", "sources")}
        for name, m in measured.items()
    }
    save_record(record, key, fields)
    return measured


@dataclass(frozen=True)
class SourceMeasurement:
    """One draft on one source's held-out prompts (or all of them: `OVERALL`): what vLLM
    measured, the offline estimate replayed over the same replies (None for another
    draft: it has no replay), and how many generations equal the target's own."""

    measured: Measurement
    estimate: Acceptance | None = None
    same_as_target: int | None = None


@dataclass(frozen=True)
class DraftMeasurements:
    """Per source and `OVERALL`: the trained draft, the untrained one (empty unless
    asked) and other drafts by name, all on the same prompts."""

    trained: dict[str, SourceMeasurement]
    untrained: dict[str, SourceMeasurement]
    others: dict[str, dict[str, SourceMeasurement]]
    weights_sha256: dict[str, str] = field(default_factory=dict)
    """What was served: `trained`, `untrained` or another draft's name -> its weights."""

    def served(self) -> dict[str, dict[str, SourceMeasurement]]:
        """Every draft served, by the name the table gives it."""
        mine = {"trained": self.trained, "untrained": self.untrained}
        return {name: f for name, f in (mine | self.others).items() if f}

    @property
    def reused(self) -> bool:
        return all(f[OVERALL].measured.reused for f in self.served().values())


def _method(draft_dir: Path) -> str:
    """How vLLM serves the draft: its family, as its checkpoint says (checked)."""
    return family_of(read_checkpoint_config(draft_dir), str(draft_dir)).name


def measure_draft(
    job: SpeculatorJob,
    outcome: SpeculatorOutcome,
    tables: TableStore,
    serving: Serving,
    settings: MeasurementSettings,
    reuse: bool = True,
    others: dict[str, Path] | None = None,
) -> DraftMeasurements:
    """What vLLM measures (`measured_groups`) of a training outcome on each source's
    held-out replies' prompts; with `measure_untrained_in_vllm`, of the same draft
    before training (`SpeculatorJob.untrained_dir`); and of `others` (name -> checkpoint
    directory), one server each."""
    sources, replayed = list(outcome.sources), outcome.result.held_out_replies
    replies = source_replies(tables, replayed, sources, settings.vllm_prompts)
    groups = {source: [r.prompt for r in rs] for source, rs in replies.items()}
    max_tokens, ttt_steps = settings.vllm_max_tokens, job.settings.ttt_steps
    served: dict[str, str] = {}  # the table's name for what was served -> its weights
    labels = {"trained": job.partition, "untrained": f"{job.partition}.untrained"}

    def measure(name: str, directory: Path, weights: str | None) -> dict[str, Measurement]:
        served[name] = weights = weights or file_sha256(weights_file(directory))
        draft = DraftUnderTest(directory, weights, job.settings.speculative_tokens)
        draft = dataclasses.replace(draft, method=_method(directory))  # its own family
        record = measurement_record(job.storage_root, job.partition, labels.get(name, name))
        limits = (max_tokens, settings.vllm_concurrency)
        return measured_groups(serving, draft, groups, limits, record, reuse)

    def figures(
        measured: dict[str, Measurement], walks: dict[str, list[list[int]]] | None
    ) -> dict[str, SourceMeasurement]:
        out, every = {}, []
        walks = walks if job.settings.speculative_tokens == ttt_steps else None  # its depth
        for source, m in measured.items():
            mine = [walks[r.row_id][r.reply] for r in replies[source]] if walks is not None else []
            every += mine
            estimate = summarize(mine, ttt_steps, max_tokens) if walks is not None else None
            out[source] = SourceMeasurement(
                m, estimate, same_as_target(replies[source], m.generations, max_tokens)
            )
        overall = summarize(every, ttt_steps, max_tokens) if walks is not None else None
        same = [f.same_as_target for f in out.values()]
        lossless = None if None in same else sum(s for s in same if s is not None)
        out[OVERALL] = SourceMeasurement(Measurement.combined(measured), overall, lossless)
        return out

    trained = figures(measure("trained", outcome.checkpoint, outcome.weights_sha256), replayed)
    untrained = {}
    if settings.measure_untrained_in_vllm:
        weights = outcome.untrained_sha256
        untrained = figures(
            measure("untrained", job.untrained_dir, weights), outcome.untrained_replies
        )
    compared = {
        name: figures(measure(name, directory, None), None)
        for name, directory in (others or {}).items()
    }
    measured = DraftMeasurements(trained, untrained, compared, served)
    write_results(tables, TABLE, job.partition, *table_rows(job, measured, settings))
    return measured


def table_rows(
    job: SpeculatorJob, measured: DraftMeasurements, settings: MeasurementSettings
) -> tuple[str, list[dict[str, Any]], bool]:
    """The key, rows and whether reused of a measurement in `draft_measurements`."""
    tokens = job.settings.speculative_tokens
    key = json_sha256([MEASUREMENT_VERSION, measured.weights_sha256, settings.model_dump(), tokens])
    common = {
        "draft": job.partition,
        "speculative_tokens": tokens,
        "max_tokens": settings.vllm_max_tokens,
        "target_fingerprint": job.target_fingerprint,
        "measured_at": datetime.now(UTC),
    }
    rows = []
    for served, by_source in measured.served().items():
        for source, f in by_source.items():
            m, estimate = f.measured, f.estimate
            rows.append(
                {
                    **common,
                    "served": served,
                    "source": source,
                    "prompts": len(m.prompts),
                    "drafts": m.acceptance.drafts,
                    "accepted": m.acceptance.accepted,
                    "acceptance_length": m.acceptance_length,
                    "acceptance_low": (interval := m.interval) and interval.low,
                    "acceptance_high": interval and interval.high,
                    "per_position_acceptance": m.per_position,
                    "acceptance_length_estimate": estimate and estimate.acceptance_length,
                    "lossless": f.same_as_target,
                    "served_sha256": measured.weights_sha256[served],
                }
            )
    return key, rows, measured.reused
