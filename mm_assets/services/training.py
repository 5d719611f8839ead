"""From a partition's stored hidden states to a speculators-format EAGLE-3 checkpoint.

Shared by the `trained_speculator` asset (one process) and `python -m mm_assets.train`
(the same job under `torchrun`, for several GPUs).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mm_assets.clients.vllm_client import ExtractionRequest
from mm_assets.common.hashing import file_sha256, json_sha256
from mm_assets.domain.model.acceptance import summarize
from mm_assets.domain.model.checkpoint import checkpoint_config, draft_from, draft_state
from mm_assets.domain.model.draft_vocab import build_draft_vocab
from mm_assets.domain.model.eagle3 import Eagle3Config, Eagle3Draft
from mm_assets.domain.model.hidden_states import LAYER_CONVENTION
from mm_assets.domain.model.settings import TRAINING_VERSION, SpeculatorSettings
from mm_assets.domain.model.trainer import (
    BatchSource,
    Ranks,
    StateStore,
    StoredBatches,
    TrainResult,
    evaluate,
    replies_of,
    train,
)
from mm_assets.domain.model.training_data import SampleRef, check_layer_ids, split
from mm_assets.services.online_batches import OnlineBatches
from mm_assets.services.online_states import FetchReport, OnlineStates
from mm_assets.services.target import TargetModel
from mm_assets.services.target_weights import load_target_head
from mm_assets.storage import TableStore
from mm_assets.storage.checkpoints import TrainStateFile, read_checkpoint, write_checkpoint
from mm_assets.storage.records import load_record, save_record

OUTCOME_RECORD = "mm_assets_outcome.json"
TRAINING_TABLES = ("tokenized_samples", "token_frequencies", "hidden_states_manifest")
ONLINE_TABLES = ("tokenized_samples", "token_frequencies")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeculatorJob:
    """One training: a partition's stored data, the target, and the settings."""

    partition: str
    storage_root: Path
    target_dir: Path
    target_config: dict[str, Any]
    target_fingerprint: str
    layer_ids: list[int]
    settings: SpeculatorSettings
    online: OnlineStates | None = None
    """How states are fetched while training; None: train on the stored ones."""

    @classmethod
    def for_target(
        cls,
        partition: str,
        storage_root: Path,
        target: TargetModel,
        settings: SpeculatorSettings,
        tables: TableStore,
        online: OnlineStates | None = None,
    ) -> SpeculatorJob:
        """The job for the layer ids the partition's states are made with: those
        `hidden_states` stored them with, or online, those its settings name (checked
        against the target); decided there, once, and never chosen again here."""
        layer_ids = online.layout.layer_ids if online else stored_layer_ids(tables, partition)
        return cls(
            partition, storage_root, target.local_dir, target.config, target.fingerprint,
            layer_ids, settings, online,
        )  # fmt: skip

    @property
    def checkpoint_dir(self) -> Path:
        return self.storage_root / "speculators" / self.partition

    @property
    def untrained_dir(self) -> Path:
        """The draft as initialised, before any step: the baseline the trained draft is
        measured against on the same prompts (a draft that learned nothing stays there)."""
        return self.storage_root / "untrained_speculators" / self.partition

    @property
    def state_dir(self) -> Path:
        return self.storage_root / "train_state" / self.partition


@dataclass
class SpeculatorOutcome:
    checkpoint: Path
    config: Eagle3Config
    result: TrainResult
    untrained_acceptance: float
    train_rows: int
    held_out: list[SampleRef]
    untrained_replies: dict[str, list[list[int]]]
    """The untrained draft's replay of the held-out replies (`TrainResult.held_out_replies`)."""
    reused: bool = False
    """True when an identical earlier training was found and nothing was trained."""
    weights_sha256: str | None = None
    """Hash of the saved `model.safetensors` (None on ranks that do not save)."""
    untrained_sha256: str | None = None
    """Hash of the untrained draft's `model.safetensors` (`SpeculatorJob.untrained_dir`)."""
    fetch: FetchReport | None = None
    """Online: what fetching the states took, pass by pass."""


def stored_layer_ids(tables: TableStore, partition: str) -> list[int]:
    """The layer ids of the partition's stored hidden states (one set for every row)."""
    found = {
        tuple(row["layer_ids"])
        for row in tables.iter_rows("hidden_states_manifest", partition, ["layer_ids"])
    }
    if len(found) != 1:
        state = "no stored row" if not found else f"rows of several layer ids {sorted(found)}"
        raise ValueError(
            f"hidden_states of {partition!r} has {state}: materialize hidden_states for "
            "this partition (with one `layer_ids`) before training"
        )
    return list(found.pop())


def sample_refs(tables: TableStore, partition: str, layer_ids: list[int]) -> list[SampleRef]:
    """Rows with stored hidden states, refusing states of other layer ids."""
    manifest = list(tables.iter_rows("hidden_states_manifest", partition))
    check_layer_ids(manifest, layer_ids)
    columns = ["row_id", "input_ids", "loss_mask"]
    tokens = {r["row_id"]: r for r in tables.iter_rows("tokenized_samples", partition, columns)}
    return [
        SampleRef(
            m["row_id"],
            str(tables.resolve(m["path"])),
            tokens[m["row_id"]]["input_ids"],
            tokens[m["row_id"]]["loss_mask"],
        )
        for m in manifest
        if m["row_id"] in tokens and len(tokens[m["row_id"]]["input_ids"]) > 1
    ]


def training_data(
    job: SpeculatorJob, tables: TableStore
) -> tuple[list[SampleRef], dict[str, str], dict[str, ExtractionRequest]]:
    """The rows to train on: those with stored states, or online every tokenized row
    (with each one's blob key and extraction request)."""
    if job.online is None:
        return sample_refs(tables, job.partition, job.layer_ids), {}, {}
    columns = ["row_id", "sample_id", "input_ids", "image_hashes", "loss_mask", "messages"]
    rows = [
        r for r in tables.iter_rows(ONLINE_TABLES[0], job.partition, columns)
        if len(r["input_ids"]) > 1
    ]  # fmt: skip
    return job.online.training_rows(rows)


def training_key(job: SpeculatorJob, tables: TableStore) -> str:
    """What the checkpoint depends on: the partition's tables (by content), the target,
    the layer ids and every setting (the device is not one: it changes nothing learned);
    online, what the states are instead of the manifest of stored ones."""
    online = job.online
    states = None if online is None else ["online", online.layout.dtype, online.layout.storage.name]
    return json_sha256(
        [
            TRAINING_VERSION,
            [
                tables.content_hash(table, job.partition)
                for table in (TRAINING_TABLES if online is None else ONLINE_TABLES)
            ],
            str(job.target_dir),
            job.target_fingerprint,
            job.layer_ids,
            job.settings.model_dump(),
            *([states] if states else []),
        ]
    )


@dataclass(frozen=True)
class TrainingSet:
    """What one training reads: its rows, the held-out ones, and the supervised-token
    counts the draft vocabulary is chosen from."""

    train: list[SampleRef]
    held_out: list[SampleRef]
    frequencies: dict[int, int]
    keys: dict[str, str] = field(default_factory=dict)
    """Online: each row's blob key (`training_data`)."""
    requests: dict[str, ExtractionRequest] = field(default_factory=dict)
    """Online: each row's extraction request."""


def dataset_training_set(job: SpeculatorJob, tables: TableStore) -> TrainingSet:
    """A dataset's rows (`training_data`) split by the held-out rule, and its counts."""
    refs, keys, requests = training_data(job, tables)
    train_refs, held_out = split(refs, job.settings.held_out_fraction, job.settings.seed)
    counts = tables.iter_rows("token_frequencies", job.partition)
    frequencies = {r["token_id"]: r["count"] for r in counts}
    return TrainingSet(train_refs, held_out, frequencies, keys, requests)


def _reused_outcome(
    job: SpeculatorJob, key: str, held_out: Callable[[], list[SampleRef]]
) -> SpeculatorOutcome | None:
    record = load_record(job.checkpoint_dir / OUTCOME_RECORD, key)
    weights = job.checkpoint_dir / "model.safetensors"
    if record is None or not weights.is_file():
        return None
    weights_sha256 = file_sha256(weights)
    if weights_sha256 != record.get("weights_sha256"):  # replaced since: train again
        return None
    untrained = job.untrained_dir / "model.safetensors"
    if not untrained.is_file() or file_sha256(untrained) != record.get("untrained_sha256"):
        return None
    return SpeculatorOutcome(
        job.checkpoint_dir,
        Eagle3Config.from_target(job.target_config, job.settings.draft_vocab_size),
        TrainResult(**record["result"]),
        record["untrained_acceptance"],
        record["train_rows"],
        held_out(),
        record["untrained_replies"],
        reused=True,
        weights_sha256=weights_sha256,
        untrained_sha256=record["untrained_sha256"],
    )


def train_speculator(
    job: SpeculatorJob,
    tables: TableStore,
    reuse: bool = True,
    device: str = "auto",
    draft: tuple[str, Callable[[], TrainingSet]] | None = None,
) -> SpeculatorOutcome:
    """Train and save the draft, or, with `reuse`, return the checkpoint an identical
    earlier job left (its weights verified by hash) without training. Without `reuse`,
    training starts from the first epoch, not from a saved training state. `draft`: the
    reuse key and the training set of a draft trained on several datasets; by default
    the partition's own (`dataset_training_set`)."""
    key, data = draft or (training_key(job, tables), lambda: dataset_training_set(job, tables))
    if reuse and (outcome := _reused_outcome(job, key, lambda: data().held_out)):
        logger.info("reusing %s: trained from identical inputs and settings", job.checkpoint_dir)
        return outcome
    rows = data()
    with contextlib.ExitStack() as stack:
        source: BatchSource = StoredBatches()
        if job.online is not None:
            source = stack.enter_context(OnlineBatches(job.online, rows.keys, rows.requests))
        outcome, model = _train(job, rows, source, device, resume=reuse)
    if isinstance(source, OnlineBatches):
        outcome.fetch = source.report
    if _ranks().rank == 0:
        _save(job, model, outcome, key)
    return outcome


def _train(
    job: SpeculatorJob, data: TrainingSet, source: BatchSource, device: str, resume: bool
) -> tuple[SpeculatorOutcome, Eagle3Draft]:
    settings = job.settings
    torch.manual_seed(settings.seed)
    cfg = Eagle3Config.from_target(job.target_config, settings.draft_vocab_size)
    vocab = build_draft_vocab(data.frequencies, cfg.vocab_size, cfg.draft_vocab_size)
    model = Eagle3Draft(cfg)
    head = load_target_head(job.target_dir)
    model.init_from_target(head.embed_tokens, head.lm_head, head.final_norm, vocab)
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
        untrained_sha256 = file_sha256(job.untrained_dir / "model.safetensors")
    states: StateStore = TrainStateFile(job.state_dir / "train_state.pt")
    if not resume:
        states = _FromScratch(states)
    result = train(
        model, train_refs, held_out, settings, states, full_lm_head=head.lm_head,
        device=device, ranks=ranks, source=source,
    )  # fmt: skip
    outcome = SpeculatorOutcome(
        job.checkpoint_dir, cfg, result, untrained.acceptance_length, len(train_refs),
        held_out, untrained_replies, untrained_sha256=untrained_sha256,
    )  # fmt: skip
    return outcome, model


@dataclass(frozen=True)
class _FromScratch:
    """A state store with nothing to resume from (`retrain`), saving as usual."""

    store: StateStore

    def load(self, device: torch.device) -> None:
        return None

    def save(self, state: dict[str, Any]) -> None:
        self.store.save(state)


def _ranks() -> Ranks:
    """The torchrun process group when one is initialised (rank 0 writes checkpoints),
    else this process alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return Ranks()
    ddp = torch.nn.parallel.DistributedDataParallel
    return Ranks(dist.get_rank(), dist.get_world_size(), ddp)


def save_checkpoint(model: Eagle3Draft, config: dict[str, Any], out_dir: Path) -> Path:
    return write_checkpoint(out_dir, config, draft_state(model))


def load_checkpoint(path: Path) -> tuple[Eagle3Draft, dict[str, Any]]:
    config, state = read_checkpoint(path)
    return draft_from(config, state, str(path)), config


def _checkpoint_config(job: SpeculatorJob, cfg: Eagle3Config, extra: dict[str, Any]) -> dict:
    provenance = {
        "dataset": job.partition,
        "layer_ids": job.layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "target_fingerprint": job.target_fingerprint,
        "ttt_steps": job.settings.ttt_steps,
        "epochs": job.settings.epochs,
        **extra,
    }
    return checkpoint_config(
        cfg, job.layer_ids[:3], str(job.target_dir),
        list(job.target_config.get("architectures") or []), job.settings.speculative_tokens,
        provenance,
    )  # fmt: skip


def _save(job: SpeculatorJob, model: Eagle3Draft, outcome: SpeculatorOutcome, key: str) -> None:
    """The checkpoint in the speculators format, and the record that lets an identical
    job reuse it."""
    estimate = {"held_out_acceptance_estimate": outcome.result.held_out_acceptance}
    save_checkpoint(
        model.cpu(), _checkpoint_config(job, outcome.config, estimate), job.checkpoint_dir
    )
    outcome.weights_sha256 = file_sha256(job.checkpoint_dir / "model.safetensors")
    record = {
        "untrained_sha256": outcome.untrained_sha256,
        "weights_sha256": outcome.weights_sha256,
        "result": asdict(outcome.result),
        "untrained_acceptance": outcome.untrained_acceptance,
        "untrained_replies": outcome.untrained_replies,
        "train_rows": outcome.train_rows,
    }
    save_record(job.checkpoint_dir / OUTCOME_RECORD, key, record)
