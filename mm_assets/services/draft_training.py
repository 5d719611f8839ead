"""A draft trained on several datasets (a `drafts:` entry of the registry), from its
sources' stored tables and hidden-state blobs: nothing is extracted again.

The training set is `domain.model.draft_set` over each source's rows with stored states;
training, checkpoints, reuse and resume are those of a one-dataset draft
(`services.training.train_speculator`), under the draft's name.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from mm_assets.common.hashing import json_sha256
from mm_assets.domain.model.draft_set import DraftSet, SourceRows, draft_set, prompt_key
from mm_assets.domain.model.settings import TRAINING_VERSION, SpeculatorSettings
from mm_assets.registry import DraftSpec
from mm_assets.services.target import TargetModel
from mm_assets.services.training import (
    TRAINING_TABLES,
    SpeculatorJob,
    SpeculatorOutcome,
    TrainingSet,
    sample_refs,
    stored_layer_ids,
    train_speculator,
)
from mm_assets.storage import TableStore

logger = logging.getLogger(__name__)
# what a draft reads of each source: the training tables, and the conversations whose
# prompt side names a row across sources
SOURCE_TABLES = (*TRAINING_TABLES, "normalized_conversations")


@dataclass
class DraftOutcome:
    outcome: SpeculatorOutcome
    rows: DraftSet


def draft_layer_ids(tables: TableStore, draft: DraftSpec) -> list[int]:
    """The layer ids every source's states were stored with (one set, or refused)."""
    found = {name: stored_layer_ids(tables, name) for name in draft.sources}
    if len({tuple(ids) for ids in found.values()}) != 1:
        raise ValueError(
            f"draft {draft.name!r}: its sources' hidden states have other layer ids "
            f"({found}); rematerialize hidden_states of each with the same layer_ids"
        )
    return next(iter(found.values()))


def row_keys(tables: TableStore, partition: str) -> dict[str, str]:
    """Each tokenized row's conversation prompt key, plus its place in the conversation
    (a row per reply has `/turnN` after the sample id)."""
    columns = ["sample_id", "turns", "image_hashes"]
    prompts = {
        row["sample_id"]: prompt_key(json.loads(row["turns"]), row["image_hashes"] or [])
        for row in tables.iter_rows("normalized_conversations", partition, columns)
    }
    return {
        row["row_id"]: prompts.get(row["sample_id"], row["sample_id"])
        + row["row_id"][len(row["sample_id"]) :]
        for row in tables.iter_rows("tokenized_samples", partition, ["row_id", "sample_id"])
    }


def build_draft_set(
    tables: TableStore, draft: DraftSpec, settings: SpeculatorSettings, layer_ids: list[int]
) -> DraftSet:
    sources = [
        SourceRows(name, sample_refs(tables, name, layer_ids), row_keys(tables, name),
                   cap.max_rows, cap.fraction)
        for name, cap in draft.sources.items()
    ]  # fmt: skip
    return draft_set(sources, settings.held_out_fraction, settings.seed)


def draft_key(job: SpeculatorJob, draft: DraftSpec, tables: TableStore) -> str:
    """What the draft's checkpoint depends on: every source's tables (by content) and
    cap, the target, the layer ids and the settings."""
    sources = {
        name: [cap.model_dump(), [tables.content_hash(t, name) for t in SOURCE_TABLES]]
        for name, cap in draft.sources.items()
    }
    return json_sha256(
        [TRAINING_VERSION, "draft", sources, str(job.target_dir), job.target_fingerprint,
         job.layer_ids, job.settings.model_dump()]
    )  # fmt: skip


def train_draft(
    draft: DraftSpec,
    storage_root: Path,
    target: TargetModel,
    settings: SpeculatorSettings,
    tables: TableStore,
    reuse: bool = True,
) -> tuple[SpeculatorJob, DraftOutcome]:
    """Train the draft on its sources (or reuse the checkpoint of identical inputs)."""
    layer_ids = draft_layer_ids(tables, draft)
    job = SpeculatorJob(
        draft.name, storage_root, target.local_dir, target.config, target.fingerprint,
        layer_ids, settings,
    )  # fmt: skip
    rows = build_draft_set(tables, draft, settings, layer_ids)
    for name, figures in rows.figures.items():
        logger.info("%s: %s", name, figures)
    data = TrainingSet(rows.train, rows.held_out, rows.frequencies)
    outcome = train_speculator(
        job, tables, reuse, draft=(draft_key(job, draft, tables), lambda: data)
    )
    return job, DraftOutcome(outcome, rows)
