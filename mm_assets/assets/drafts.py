"""Drafts trained on several datasets: `trained_draft`, one partition per `drafts:` entry
of the registry, reading its sources' stored hidden states."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field

from mm_assets.assets.config import M, config_class, stage_settings
from mm_assets.assets.metadata import fetch_metadata, rounded, table_links
from mm_assets.assets.model import hidden_states, online_states, training_metadata
from mm_assets.assets.partitions import (
    REGISTRY,
    accelerator_asset,
    draft_partitions,
    draft_spec,
    sources_of_drafts,
)
from mm_assets.assets.resources import StorageResource, TargetModelResource, VllmResource
from mm_assets.domain.model.settings import (
    TRAINING_VERSION,
    MeasurementSettings,
    OnlineSettings,
    SpeculatorSettings,
    TrackingSettings,
)
from mm_assets.services.media import sources_media_root
from mm_assets.services.tracking import Tracking
from mm_assets.storage.layout import DRAFTS, StorageLayout, has_weights
from mm_assets.storage.object_store import publish_directory

if TYPE_CHECKING:
    from mm_assets.services.measurement import DraftMeasurements
    from mm_assets.services.training import SpeculatorOutcome

DraftConfig = config_class(
    "DraftConfig",
    "trained_speculator",
    SpeculatorSettings,
    OnlineSettings,
    MeasurementSettings,
    TrackingSettings,
    retrain=(
        bool,
        Field(False, description="Train (from the first epoch) and measure again."),
    ),
)


@accelerator_asset(
    TRAINING_VERSION,
    deps=[dg.AssetDep(hidden_states, partition_mapping=sources_of_drafts())],
    kinds={"pytorch", "safetensors"},
    partitions_def=draft_partitions,
)
def trained_draft(
    context: dg.AssetExecutionContext,
    config: DraftConfig,  # type: ignore[valid-type]
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
    from mm_assets.services.measurement import measure_draft
    from mm_assets.services.training import SpeculatorJob, train_speculator

    draft, tables, root = draft_spec(context), storage.tables(), storage.root_dir()

    def setting(model: type[M]) -> M:  # the trained_speculator settings, launched here
        return stage_settings(context, draft, "trained_speculator", model, "trained_draft")

    settings, measure = setting(SpeculatorSettings), setting(MeasurementSettings)
    online, target = setting(OnlineSettings), target_model.model()
    states = None
    if online.hidden_states == "online":
        states = online_states(context, draft, storage, target, vllm, online)
    job = SpeculatorJob.for_draft(draft, root, target, settings, tables, states)
    tracking = Tracking(setting(TrackingSettings), context.run.run_id)
    outcome = train_speculator(job, draft, tables, not config.retrain, tracking=tracking)
    metadata = training_metadata(job, outcome) | sources_metadata(outcome)
    metadata |= fetch_metadata(online, outcome.fetch)
    if measure.measure_in_vllm:
        own = {s: StorageLayout(root).draft(s) for s in draft.sources}
        others = {s: d for s, d in own.items() if has_weights(d)}
        log = storage.log_path(f"vllm_draft_{context.run.run_id}")
        sources = [REGISTRY[s] for s in draft.sources]
        serving = vllm.serving(target, sources_media_root(sources, tables, root), log)
        compared = others if measure.compare_with_sources else {}
        measured = measure_draft(
            job, outcome, tables, serving, measure, not config.retrain, compared
        )
        metadata |= by_source_metadata(draft.name, measured)
        metadata |= table_links(tables, "draft_measurements", draft.name)
    if (store := storage.checkpoint_store()) is not None:
        url, uploaded = publish_directory(store, outcome.checkpoint, DRAFTS, draft.name)
        metadata["checkpoint_url"] = dg.MetadataValue.path(url)
        metadata["checkpoint_files_uploaded"] = uploaded
    assert outcome.weights_sha256 is not None
    return dg.MaterializeResult(
        metadata=rounded(metadata), data_version=dg.DataVersion(outcome.weights_sha256)
    )


def sources_metadata(outcome: SpeculatorOutcome) -> dict[str, Any]:
    lines = [
        "| source | rows | held out | tokens | supervised | left out by the cap | duplicates |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in outcome.sources.items():
        lines.append(
            f"| {name} | {f.rows} | {f.held_out} | {f.tokens} | {f.supervised} | {f.capped} | "
            f"{f.duplicates} |"
        )
    return {
        "sources": dg.MetadataValue.md("\n".join(lines)),
        "duplicates_by_source_pair": dict(outcome.duplicates),
        **{f"rows_{name}": f.rows for name, f in outcome.sources.items()},
    }


def by_source_metadata(name: str, measured: DraftMeasurements) -> dict[str, Any]:
    """A Markdown table draft × source (vLLM-measured acceptance), and this draft's
    figures per source as numbers (the Plots tab)."""
    sources = list(measured.trained)
    rows = {f"**{name}**": measured.trained}
    if measured.untrained:
        rows[f"{name} (untrained)"] = measured.untrained
    rows |= {f"{other} (its own draft)": figures for other, figures in measured.others.items()}
    lines = ["| draft | " + " | ".join(sources) + " |", "|---|" + "---:|" * len(sources)]
    for label, figures in rows.items():
        cells = [
            f"{figures[s].measured.acceptance_length:.3f}" if s in figures else "" for s in sources
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    out: dict[str, Any] = {"vllm_acceptance_by_source": dg.MetadataValue.md("\n".join(lines))}
    for source, f in measured.trained.items():
        out[f"vllm_acceptance_length_{source}"] = f.measured.acceptance_length
        out[f"vllm_per_position_acceptance_{source}"] = [
            round(r, 4) for r in f.measured.per_position
        ]
        out[f"vllm_prompts_{source}"] = len(f.measured.prompts)
        if f.estimate is not None:
            out[f"vllm_acceptance_length_estimate_{source}"] = f.estimate.acceptance_length
        if f.same_as_target is not None:
            out[f"vllm_generations_same_as_target_{source}"] = f.same_as_target
    for source, f in measured.untrained.items():
        out[f"vllm_untrained_acceptance_length_{source}"] = f.measured.acceptance_length
    return out
