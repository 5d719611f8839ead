"""From a partition's stored hidden states to a speculators-format EAGLE-3 checkpoint.

Shared by the `trained_speculator` asset (one process) and `python -m mm_assets.train`
(the same job under `torchrun`, for several GPUs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mm_assets.domain.draft_vocab import build_draft_vocab
from mm_assets.domain.eagle3 import Eagle3Config, Eagle3Draft, acceptance_length
from mm_assets.domain.hidden_states import LAYER_CONVENTION
from mm_assets.domain.speculator_checkpoint import checkpoint_config, save_checkpoint
from mm_assets.domain.target_weights import load_target_head
from mm_assets.domain.trainer import TrainResult, TrainSettings, evaluate, train
from mm_assets.domain.training_data import SampleRef, check_layer_ids, split
from mm_assets.storage import TableStore


@dataclass(frozen=True)
class SpeculatorJob:
    partition: str
    storage_root: Path
    target_dir: Path
    target_config: dict[str, Any]
    target_fingerprint: str
    layer_ids: list[int]
    draft_vocab_size: int
    held_out_fraction: float
    speculative_tokens: int
    settings: TrainSettings

    @property
    def checkpoint_dir(self) -> Path:
        return self.storage_root / "speculators" / self.partition

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


def sample_refs(tables: TableStore, partition: str, layer_ids: list[int]) -> list[SampleRef]:
    """Rows with stored hidden states, refusing states of other layer ids."""
    manifest = list(tables.iter_rows("hidden_states_manifest", partition))
    check_layer_ids(manifest, layer_ids)
    columns = ["row_id", "input_ids", "loss_mask"]
    tokens = {r["row_id"]: r for r in tables.iter_rows("tokenized_samples", partition, columns)}
    return [
        SampleRef(
            m["row_id"],
            m["path"],
            tokens[m["row_id"]]["input_ids"],
            tokens[m["row_id"]]["loss_mask"],
        )
        for m in manifest
        if m["row_id"] in tokens and len(tokens[m["row_id"]]["input_ids"]) > 1
    ]


def train_speculator(
    job: SpeculatorJob, tables: TableStore, log: Callable[[str], None] = print
) -> SpeculatorOutcome:
    refs = sample_refs(tables, job.partition, job.layer_ids)
    frequencies = {
        r["token_id"]: r["count"] for r in tables.iter_rows("token_frequencies", job.partition)
    }
    torch.manual_seed(job.settings.seed)
    cfg = Eagle3Config.from_target(job.target_config, job.draft_vocab_size)
    vocab = build_draft_vocab(frequencies, cfg.vocab_size, cfg.draft_vocab_size)
    model = Eagle3Draft(cfg)
    head = load_target_head(job.target_dir)
    model.init_from_target(head.embed_tokens, head.lm_head, head.final_norm, vocab)
    train_refs, held_out = split(refs, job.held_out_fraction, job.settings.seed)
    # acceptance needs the target's own greedy token, over its whole vocabulary
    _, untrained_accuracy = evaluate(model, held_out, job.settings, head.lm_head)
    result = train(
        model, train_refs, held_out, job.settings, job.state_dir, log, full_lm_head=head.lm_head
    )
    provenance = {
        "dataset": job.partition,
        "layer_ids": job.layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "target_fingerprint": job.target_fingerprint,
        "ttt_steps": job.settings.ttt_steps,
        "epochs": job.settings.epochs,
        "held_out_acceptance_estimate": result.held_out_acceptance,
    }
    config = checkpoint_config(
        cfg,
        job.layer_ids[:3],
        str(job.target_dir),
        list(job.target_config.get("architectures") or []),
        job.speculative_tokens,
        provenance,
    )
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        save_checkpoint(model.cpu(), config, job.checkpoint_dir)
    return SpeculatorOutcome(
        job.checkpoint_dir,
        cfg,
        result,
        acceptance_length(untrained_accuracy),
        len(train_refs),
        held_out,
    )
