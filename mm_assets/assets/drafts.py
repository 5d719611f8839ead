"""Drafts trained on several datasets: `trained_draft`, one partition per `drafts:` entry
of the registry, reading its sources' stored hidden states."""

from __future__ import annotations

import dagster as dg

from mm_assets.assets.model import SpeculatorConfig, hidden_states, train_step
from mm_assets.assets.partitions import (
    accelerator_asset,
    draft_partitions,
    draft_spec,
    sources_of_drafts,
)
from mm_assets.assets.resources import StorageResource, TargetModelResource, VllmResource
from mm_assets.domain.model.settings import TRAINING_VERSION


@accelerator_asset(
    TRAINING_VERSION,
    deps=[dg.AssetDep(hidden_states, partition_mapping=sources_of_drafts())],
    kinds={"pytorch", "safetensors"},
    partitions_def=draft_partitions,
)
def trained_draft(
    context: dg.AssetExecutionContext,
    config: SpeculatorConfig,  # type: ignore[valid-type]
    storage: StorageResource,
    target_model: TargetModelResource,
    vllm: VllmResource,
) -> dg.MaterializeResult:
    """An EAGLE-3 draft trained on several datasets (a `drafts:` entry: its sources, each
    capped), from their stored hidden states or, with `hidden_states: online`, states
    fetched from vLLM while it trains (each source's rows the same way): a conversation
    that two sources hold trains once, every source keeps held-out rows by the rule its
    own draft uses, and the draft is measured per source — offline and in vLLM — beside
    each source's own draft on the same prompts (`compare_with_sources`). Written as
    `speculators/<draft>/`."""
    return train_step(context, draft_spec(context), config.retrain, storage, target_model, vllm)
