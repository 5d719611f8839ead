"""From a partition's stored hidden states to a speculators-format EAGLE-3 checkpoint.

Shared by the `trained_speculator` asset (one process) and `python -m mm_assets.train`
(the same job under `torchrun`, for several GPUs).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mm_assets.clients.vllm_client import ExtractionRequest
from mm_assets.common.hashing import file_sha256, json_sha256
from mm_assets.domain.model.acceptance import replies_of, summarize
from mm_assets.domain.model.checkpoint import draft_state
from mm_assets.domain.model.draft_parts import DraftModel
from mm_assets.domain.model.draft_set import (
    SEPARATOR,
    DraftSet,
    SourceFigures,
    SourceRows,
    draft_set,
)
from mm_assets.domain.model.draft_vocab import build_draft_vocab
from mm_assets.domain.model.families import FAMILIES, DraftConfig, family_of
from mm_assets.domain.model.hidden_states import LAYER_CONVENTION
from mm_assets.domain.model.settings import TRAINING_VERSION, SpeculatorSettings
from mm_assets.domain.model.trainer import (
    BatchSource,
    Ranks,
    StoredBatches,
    TrainingRun,
    TrainResult,
    evaluate,
    train,
)
from mm_assets.domain.model.training_data import SAMPLE_COLUMNS, SampleRef
from mm_assets.registry import DraftSpec
from mm_assets.services.draft_sources import (
    DUPLICATE_TABLES,
    ONLINE_TABLES,
    TRAINING_TABLES,
    draft_layer_ids,
    row_keys,
    sample_refs,
)
from mm_assets.services.online_batches import FetchReport, OnlineBatches, OnlineStates
from mm_assets.services.target import TargetModel, load_target_head
from mm_assets.services.tracking import Tracking, open_tracker
from mm_assets.services.warm_start import InitSource, locate, warm_draft
from mm_assets.storage import TableStore
from mm_assets.storage.checkpoints import TrainStateFile, write_checkpoint
from mm_assets.storage.layout import StorageLayout, weights
from mm_assets.storage.records import load_record, save_record

OUTCOME_RECORD = "mm_assets_outcome.json"
# what the record keeps of an outcome, besides its `TrainResult`
RECORDED = (
    "untrained_sha256",
    "weights_sha256",
    "untrained_acceptance",
    "untrained_replies",
    "train_rows",
)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeculatorJob:
    """One training: a draft (`partition`: its name), the target, the layer ids its
    sources' states are made with, and the settings."""

    partition: str
    storage_root: Path
    target_dir: Path
    target_config: dict[str, Any]
    target_fingerprint: str
    layer_ids: list[int]
    settings: SpeculatorSettings
    online: OnlineStates | None = None  # None: train on the stored states
    init: InitSource | None = None  # `init_from`; None: random weights

    @classmethod
    def for_draft(
        cls,
        draft: DraftSpec,
        storage_root: Path,
        target: TargetModel,
        settings: SpeculatorSettings,
        tables: TableStore,
        online: OnlineStates | None = None,
    ) -> SpeculatorJob:
        """The job for the layer ids the sources' states were stored with, or online,
        those its settings name (decided there, once, never chosen again here)."""
        layer_ids = online.layout.layer_ids if online else draft_layer_ids(tables, draft)
        given, layout = settings.init_from, StorageLayout(storage_root)
        init = locate(given, layout, settings.init_revision) if given else None
        return cls(
            draft.name,
            storage_root,
            target.local_dir,
            target.config,
            target.fingerprint,
            layer_ids,
            settings,
            online,
            init,
        )

    @property
    def layout(self) -> StorageLayout:
        return StorageLayout(self.storage_root)

    @property
    def checkpoint_dir(self) -> Path:
        return self.layout.draft(self.partition)

    @property
    def untrained_dir(self) -> Path:
        """The draft as initialised, before any step: the baseline the trained draft is
        measured against on the same prompts (a draft that learned nothing stays there)."""
        return self.layout.untrained_draft(self.partition)


@dataclass
class SpeculatorOutcome:
    checkpoint: Path
    config: DraftConfig
    result: TrainResult
    untrained_acceptance: float | None
    train_rows: int
    held_out: list[SampleRef]
    untrained_replies: dict[str, list[list[int]]]  # as `TrainResult.held_out_replies`
    reused: bool = False  # an identical earlier training was found: nothing trained
    weights_sha256: str | None = None  # None on ranks that do not save
    untrained_sha256: str | None = None
    fetch: FetchReport | None = None  # online: what fetching the states took
    sources: dict[str, SourceFigures] = field(default_factory=dict)  # `draft_set`'s
    duplicates: dict[str, int] = field(default_factory=dict)
    """`kept_by/dropped_from` -> rows of conversations both sources hold, trained once."""


@dataclass(frozen=True)
class TrainingSet:
    """What one training reads: the draft's rows (`draft_set`), and online each row's
    blob key and extraction request (`OnlineStates.training_rows`)."""

    rows: DraftSet
    keys: dict[str, str] = field(default_factory=dict)
    requests: dict[str, ExtractionRequest] = field(default_factory=dict)


def training_set(job: SpeculatorJob, draft: DraftSpec, tables: TableStore) -> TrainingSet:
    """Each source's rows with stored states (online, every tokenized row), as one set."""
    several = len(draft.sources) > 1
    sources, keys, requests = [], {}, {}
    for name, cap in draft.sources.items():
        if job.online is None:
            refs = sample_refs(tables, name, job.layer_ids)
        else:
            columns = [*SAMPLE_COLUMNS, "sample_id", "image_hashes", "messages"]
            every = tables.iter_rows("tokenized_samples", name, columns)
            rows = [r for r in every if len(r["input_ids"]) > 1]
            refs, blob_keys, asked = job.online.training_rows(rows)
            keys |= {f"{name}{SEPARATOR}{k}": v for k, v in blob_keys.items()}
            requests |= {f"{name}{SEPARATOR}{k}": v for k, v in asked.items()}
        prompts = row_keys(tables, name) if several else {}
        sources.append(SourceRows(name, refs, prompts, cap.max_rows, cap.fraction))
    rows = draft_set(sources, job.settings.held_out_fraction, job.settings.held_out_seed)
    if not rows.train:
        raise ValueError(
            f"draft {draft.name!r}: no training rows left after the held-out split; lower "
            "held_out_fraction or add rows"
        )
    return TrainingSet(rows, keys, requests)


def training_key(job: SpeculatorJob, draft: DraftSpec, tables: TableStore) -> str:
    """What the checkpoint depends on: every source's tables it reads (by content) and
    cap, the target, the layer ids and every setting (the device is not one: it changes
    nothing learned); online, what the states are instead of the stored ones."""
    online = job.online
    read = TRAINING_TABLES if online is None else ONLINE_TABLES
    read += DUPLICATE_TABLES if len(draft.sources) > 1 else ()
    sources = {
        name: [cap.model_dump(), [tables.content_hash(t, name) for t in read]]
        for name, cap in draft.sources.items()
    }
    states = None if online is None else ["online", online.layout.dtype, online.layout.storage.name]
    return json_sha256(
        [
            TRAINING_VERSION,
            sources,
            str(job.target_dir),
            job.target_fingerprint,
            job.layer_ids,
            job.settings.model_dump(),
            states,
            job.init and job.init.sha256,
        ]
    )


def _reused_outcome(job: SpeculatorJob, key: str, data: TrainingSet) -> SpeculatorOutcome | None:
    record = load_record(job.checkpoint_dir / OUTCOME_RECORD, key)
    stored = weights(job.checkpoint_dir)
    if record is None or not stored.is_file():
        return None
    if file_sha256(stored) != record.get("weights_sha256"):  # replaced since: train again
        return None
    untrained = weights(job.untrained_dir)
    if not untrained.is_file() or file_sha256(untrained) != record.get("untrained_sha256"):
        return None
    config = json.loads((job.checkpoint_dir / "config.json").read_text())
    return SpeculatorOutcome(
        job.checkpoint_dir,
        family_of(config, str(job.checkpoint_dir)).shape(config),
        TrainResult(**record["result"]),
        held_out=data.rows.held_out,
        reused=True,
        sources=data.rows.figures,
        duplicates=data.rows.duplicates,
        **{name: record[name] for name in RECORDED},
    )


def train_speculator(
    job: SpeculatorJob,
    draft: DraftSpec,
    tables: TableStore,
    reuse: bool = True,
    device: str = "auto",
    tracking: Tracking | None = None,
) -> SpeculatorOutcome:
    """Train and save the draft, or with `reuse` return the checkpoint an identical
    earlier job left (its weights verified by hash). Without `reuse`, training starts
    from the first epoch, not from a saved training state."""
    data = training_set(job, draft, tables)
    for name, figures in data.rows.figures.items():
        logger.info("%s: %s", name, figures)
    key = training_key(job, draft, tables)
    if reuse and (outcome := _reused_outcome(job, key, data)):
        logger.info("reusing %s: trained from identical inputs and settings", job.checkpoint_dir)
        return outcome
    with contextlib.ExitStack() as stack:
        source: BatchSource = StoredBatches()
        if job.online is not None:
            source = stack.enter_context(OnlineBatches(job.online, data.keys, data.requests))
        outcome, model = _train(job, data.rows, source, device, reuse, tracking)
    if isinstance(source, OnlineBatches):
        outcome.fetch = source.report
    if _ranks().rank == 0:
        _save(job, model, outcome, key)
    return outcome


def _train(
    job: SpeculatorJob,
    data: DraftSet,
    source: BatchSource,
    device: str,
    resume: bool,
    tracking: Tracking | None,
) -> tuple[SpeculatorOutcome, DraftModel]:
    settings = job.settings
    torch.manual_seed(settings.seed)
    family = FAMILIES[settings.draft]
    for caveat in family.serving_caveats(job.target_config):
        logger.warning(caveat)
    cfg = family.new_config(job.target_config, settings)
    head = load_target_head(job.target_dir)
    if job.init is None:
        vocab = build_draft_vocab(data.frequencies, cfg.vocab_size, cfg.draft_vocab_size)
        model = family.model(cfg)
        model.init_from_target(head.embed_tokens, head.lm_head, head.final_norm, vocab)
    else:
        model, vocab = warm_draft(job.init, family, cfg, job.layer_ids, head.embed_tokens)
        model.attach_target(head.embed_tokens, head.lm_head, head.final_norm, vocab)
        cfg = model.cfg
    train_refs, held_out = data.train, data.held_out
    # acceptance needs the target's own greedy token, over its whole vocabulary
    _, untrained_replies = evaluate(
        model, held_out, settings, head.lm_head, device, source, "held-out (untrained)"
    )
    untrained = summarize(replies_of(untrained_replies), settings.ttt_steps)
    untrained_sha256 = None
    ranks = _ranks()
    if ranks.rank == 0:
        config = _checkpoint_config(job, cfg, {"untrained": True})
        save_checkpoint(model.cpu(), config, job.untrained_dir)
        untrained_sha256 = file_sha256(weights(job.untrained_dir))
    state_file = job.layout.train_state(job.partition) / "train_state.pt"
    states = TrainStateFile(state_file) if resume else _FromScratch(state_file)
    params = settings.model_dump() | {"layer_ids": job.layer_ids, "target": job.target_dir}
    tracker = open_tracker(tracking, job.partition, params, job.storage_root, ranks.rank)
    try:
        run = TrainingRun(device, ranks, source, log=tracker.log)
        result = train(model, train_refs, held_out, settings, states, head.lm_head, run)
    finally:
        tracker.close()
    outcome = SpeculatorOutcome(
        job.checkpoint_dir,
        cfg,
        result,
        untrained.acceptance_length,
        len(train_refs),
        held_out,
        untrained_replies,
        untrained_sha256=untrained_sha256,
        sources=data.figures,
        duplicates=data.duplicates,
    )
    return outcome, model


class _FromScratch(TrainStateFile):
    """A state file nothing is resumed from (`retrain`), saved as usual."""

    def load(self, device: torch.device) -> None:
        return None


def _ranks() -> Ranks:
    """The torchrun process group when one is initialised, else this process alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return Ranks()
    ddp = torch.nn.parallel.DistributedDataParallel
    return Ranks(dist.get_rank(), dist.get_world_size(), ddp)


def save_checkpoint(model: DraftModel, config: dict[str, Any], out_dir: Path) -> Path:
    return write_checkpoint(out_dir, config, draft_state(model))


def _checkpoint_config(job: SpeculatorJob, cfg: DraftConfig, extra: dict[str, Any]) -> dict:
    provenance = {
        "dataset": job.partition,
        "layer_ids": job.layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "target_fingerprint": job.target_fingerprint,
        "ttt_steps": job.settings.ttt_steps,
        "epochs": job.settings.epochs,
        **(job.init.provenance() if job.init else {}),
        **extra,
    }
    return FAMILIES[job.settings.draft].checkpoint_config(
        cfg,
        job.layer_ids[:3],
        str(job.target_dir),
        list(job.target_config.get("architectures") or []),
        job.settings.speculative_tokens,
        provenance,
    )


def _save(job: SpeculatorJob, model: DraftModel, outcome: SpeculatorOutcome, key: str) -> None:
    """The checkpoint, and the record that lets an identical job reuse it."""
    estimate = {"held_out_acceptance_estimate": outcome.result.held_out_acceptance}
    save_checkpoint(
        model.cpu(), _checkpoint_config(job, outcome.config, estimate), job.checkpoint_dir
    )
    outcome.weights_sha256 = file_sha256(weights(job.checkpoint_dir))
    record = {name: getattr(outcome, name) for name in RECORDED}
    record["result"] = asdict(outcome.result)
    save_record(job.checkpoint_dir / OUTCOME_RECORD, key, record)
