"""Model stage: hidden states from a real vLLM server, and the trained EAGLE-3 speculator."""

from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field

from mm_assets.assets.config import M, config_class, stage_settings
from mm_assets.assets.metadata import (
    acceptance_plot,
    by_source_metadata,
    fetch_metadata,
    loss_curve,
    measurement_metadata,
    rounded,
    servers_table,
    sources_metadata,
    table_links,
)
from mm_assets.assets.partitions import REGISTRY, accelerator_asset, dataset_spec
from mm_assets.assets.prep import tokenized_samples
from mm_assets.assets.resources import StorageResource, TargetModelResource, VllmResource
from mm_assets.common.hashing import json_sha256
from mm_assets.domain.model.hidden_states import LAYER_CONVENTION, ExtractionSettings
from mm_assets.domain.model.settings import (
    TRAINING_VERSION,
    MeasurementSettings,
    OnlineSettings,
    SpeculatorSettings,
    TrackingSettings,
)
from mm_assets.services.media import media_root, sources_media_root
from mm_assets.services.tracking import Tracking
from mm_assets.storage.layout import DRAFTS, StorageLayout, has_weights
from mm_assets.storage.object_store import publish_directory

if TYPE_CHECKING:
    from mm_assets.domain.model.hidden_states import HiddenStatesLayout
    from mm_assets.registry import DraftSpec
    from mm_assets.services.engine import Serving
    from mm_assets.services.extraction import ExtractionReport, PartitionExtraction
    from mm_assets.services.online_batches import OnlineStates
    from mm_assets.services.target import TargetModel
    from mm_assets.services.training import SpeculatorJob, SpeculatorOutcome

REJECTION_CHECK = "token_id_rejections"

HiddenStatesConfig = config_class("HiddenStatesConfig", "hidden_states", ExtractionSettings)


@accelerator_asset(
    "2",  # 2: the manifest's paths are relative to the storage root
    deps=[tokenized_samples],
    kinds={"vllm", "safetensors"},
    check_specs=[
        dg.AssetCheckSpec(
            REJECTION_CHECK,
            asset="hidden_states",
            blocking=True,
            description="Fails when the partition has no stored row, or when vLLM's "
            "hidden states were unusable for more rows than max_rejection_ratio (their "
            "prompt ids differ from the stored ones, wrong shape, non-finite values): "
            "training on the rest would silently skip them. If it fails: read "
            "hidden_states_rejections; token mismatches mean the served processor or its "
            "image limits differ from the ones that tokenized the rows.",
        )
    ],
)
def hidden_states(
    context: dg.AssetExecutionContext,
    config: HiddenStatesConfig,  # type: ignore[valid-type]
    storage: StorageResource,
    target_model: TargetModelResource,
    vllm: VllmResource,
) -> dg.MaterializeResult:
    """Per-row hidden states `[T, n_layers, H]` of the target, from vLLM's
    `extract_hidden_states` method, stored by content key (target, layer ids, dtype,
    input ids, image hashes, storage format) so unchanged rows are never requested twice.
    vLLM's prompt token ids are checked against the stored ones for every row. Stored as
    received (`native`, speculators' layout) or compact (`storage_dtype`, `final_layer`),
    encoded once on arrival with its error recorded. The manifest table
    `hidden_states_manifest` maps rows to blobs; rejected rows go to
    `hidden_states_rejections` with their reason."""
    from mm_assets.services.extraction import PartitionExtraction

    spec, tables, target = dataset_spec(context), storage.tables(), target_model.model()
    settings = stage_settings(context, spec, "hidden_states", ExtractionSettings)
    log = storage.log_path(f"vllm_{context.run.run_id}")
    serving = vllm.serving(target, media_root(spec, tables, storage.root_dir()), log)
    extraction = PartitionExtraction(spec.name, tables, storage.blobs(), target, serving, settings)
    online = stage_settings(context, spec, "trained_speculator", OnlineSettings)
    if online.hidden_states == "online":
        return trains_online(extraction, online)
    report = extraction.run()
    assert report.manifest is not None
    return dg.MaterializeResult(
        metadata=rounded(
            extraction_metadata(report) | table_links(tables, "hidden_states_manifest", spec.name)
        ),
        data_version=dg.DataVersion(report.manifest.content_hash),
        check_results=[rejection_check(report, settings.max_rejection_ratio)],
    )


def trains_online(
    extraction: "PartitionExtraction", online: OnlineSettings
) -> dg.MaterializeResult:
    """What an online partition's step records: no server, nothing stored, and what
    `trained_speculator` will fetch (its layer ids checked against the target here)."""
    layout, partition = extraction.layout(), extraction.partition
    tokenized = extraction.tables.content_hash("tokenized_samples", partition)
    note = (
        f"**Online** (`hidden_states: online`, `online_cache: {online.online_cache}`): nothing "
        "is stored here. `trained_speculator` fetches each batch's states from vLLM while it "
        "trains, and checks them as this step would (token ids, shapes, finite values)."
    )
    metadata = {
        "hidden_states_source": "online",
        "online": dg.MetadataValue.md(note),
        "online_cache": online.online_cache,
        **layout_metadata(layout),
    }
    key = [layout.layer_ids, layout.target_fingerprint, layout.dtype, layout.storage.name]
    version = json_sha256(["online", tokenized, *key])
    check = dg.AssetCheckResult(
        check_name=REJECTION_CHECK,
        passed=True,
        description="Online: trained_speculator checks every fetched row and fails above "
        "max_rejection_ratio (see its metadata for rejections by reason).",
    )
    return dg.MaterializeResult(
        metadata=metadata, data_version=dg.DataVersion(version), check_results=[check]
    )


def layout_metadata(layout: "HiddenStatesLayout") -> dict[str, Any]:
    return {
        "layer_ids": layout.layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "dtype": layout.dtype,
        "storage_format": layout.storage.name,
        "target_fingerprint": layout.target_fingerprint,
    }


def extraction_metadata(report: "ExtractionReport") -> dict[str, Any]:
    tally, layout = report.requests, report.layout
    return {
        "rows": report.manifest.num_rows if report.manifest else 0,
        "cache_hits": report.plan.cache_hits,
        "requests_sent": tally.requests_sent,
        "stored_now": tally.stored,
        "rejected": len(tally.rejections),
        "tokens_generated": tally.stored_tokens,
        "bytes_generated": tally.stored_bytes,
        "tokens_per_s": tally.stored_tokens / tally.seconds if tally.seconds else 0.0,
        **layout_metadata(layout),
        "stored_bytes_per_token": round(report.stored.bytes / max(report.stored.tokens, 1), 1),
        "bytes_vs_bf16_layout": round(report.stored.bf16_layout_ratio(layout.hidden_size), 4),
        "max_rel_error_per_layer": [float(f"{e:.3g}") for e in report.stored.max_rel_error],
        "server": report.server,
        "servers": servers_table(tally.servers, tally.seconds),
        "server_startup_s": tally.startup_s if tally.startup_s is not None else "n/a",
        "server_rss_mb": round(tally.server_rss_bytes / 2**20) if tally.server_rss_bytes else "n/a",
        "blobs": dg.MetadataValue.path(str(report.blobs_dir)),
    }


def rejection_check(report: "ExtractionReport", max_ratio: float) -> dg.AssetCheckResult:
    """Fails when vLLM rejected more than `max_ratio` of the rows; names the first few."""
    from mm_assets.domain.rejection import StateRejections

    rejections, reasons = report.requests.rejections, report.requests.rejections_by_reason
    mismatch, rows = bool(reasons.get("token_mismatch")), len(report.plan.rows)
    judged = StateRejections(len(rejections), rows, max_ratio, rejections, mismatch)
    stored = report.manifest.num_rows if report.manifest else 0
    description = judged.describe()
    if not stored:
        description = "No row has hidden states: nothing to train on. " + description
    return dg.AssetCheckResult(
        check_name=REJECTION_CHECK,
        passed=bool(stored) and not judged.too_many,
        description=description,
        metadata=rounded(
            {"rejection_ratio": judged.ratio, **{f"rejected_{k}": v for k, v in reasons.items()}}
        ),
    )


SpeculatorConfig = config_class(
    "SpeculatorConfig",
    "trained_speculator",
    SpeculatorSettings,
    OnlineSettings,
    MeasurementSettings,
    TrackingSettings,
    retrain=(
        bool,
        Field(
            False,
            description="Train (from the first epoch) and measure again even when nothing changed.",
        ),
    ),
)


@accelerator_asset(TRAINING_VERSION, deps=[hidden_states], kinds={"pytorch", "safetensors"})
def trained_speculator(
    context: dg.AssetExecutionContext,
    config: SpeculatorConfig,  # type: ignore[valid-type]
    storage: StorageResource,
    target_model: TargetModelResource,
    vllm: VllmResource,
) -> dg.MaterializeResult:
    """An EAGLE-3 draft for the target, trained on this partition's hidden states and
    written in the speculators format vLLM loads (`speculators/<partition>/`, and there
    under the object store when one is configured). Reports the held-out loss and the
    acceptance estimated by replaying speculative decoding over the held-out replies, and
    — with `measure_in_vllm` — the acceptance vLLM measures serving the target with it on
    those replies' prompts, beside the estimate for the same ones. A rerun whose inputs
    and settings are unchanged reuses the checkpoint and its measurement instead of
    training again (`retrain` forces it)."""
    from mm_assets.registry import DraftSpec

    draft = DraftSpec.of_dataset(dataset_spec(context))
    return train_step(context, draft, config.retrain, storage, target_model, vllm)


def train_step(
    context: dg.AssetExecutionContext,
    draft: "DraftSpec",
    retrain: bool,
    storage: StorageResource,
    target_model: TargetModelResource,
    vllm: VllmResource,
) -> dg.MaterializeResult:
    """Train `draft` with the `trained_speculator` settings (launched under this step's
    name), measure it in vLLM and publish it. A draft of several datasets is measured per
    source, beside each source's own draft (`compare_with_sources`)."""
    from mm_assets.services.measurement import measure_draft
    from mm_assets.services.training import SpeculatorJob, train_speculator

    tables, root, target = storage.tables(), storage.root_dir(), target_model.model()
    step, own = context.asset_key.to_user_string(), draft.is_dataset

    def setting(model: type[M]) -> M:
        return stage_settings(context, draft, "trained_speculator", model, step)

    settings, measure = setting(SpeculatorSettings), setting(MeasurementSettings)
    online = setting(OnlineSettings)
    states = online_states(context, draft, storage, target, vllm, online)
    job = SpeculatorJob.for_draft(draft, root, target, settings, tables, states)
    tracking = Tracking(setting(TrackingSettings), context.run.run_id)
    outcome = train_speculator(job, draft, tables, not retrain, tracking=tracking)
    metadata = training_metadata(job, outcome) | fetch_metadata(online, outcome.fetch)
    if not own:
        metadata |= sources_metadata(outcome)
    measured = None
    if measure.measure_in_vllm and (outcome.result.held_out_replies or not own):
        serving = sources_serving(context, draft, storage, target, vllm, "spec" if own else "draft")
        others = [] if own or not measure.compare_with_sources else draft.sources
        compared = {s: d for s in others if has_weights(d := StorageLayout(root).draft(s))}
        figures = measure_draft(job, outcome, tables, serving, measure, not retrain, compared)
        if own:
            measured = figures.trained[draft.name].measured
            metadata |= measurement_metadata(figures, [draft.name], per_source=False)
        else:
            metadata |= by_source_metadata(draft.name, figures)
        metadata |= table_links(tables, "draft_measurements", draft.name)
    metadata |= published(storage, outcome.checkpoint, draft.name)
    if own:
        metadata["per_position_acceptance"] = acceptance_plot(
            outcome.result.held_out_per_position, measured.per_position if measured else None
        )
    assert outcome.weights_sha256 is not None
    return dg.MaterializeResult(
        metadata=rounded(metadata), data_version=dg.DataVersion(outcome.weights_sha256)
    )


def published(storage: StorageResource, checkpoint: Path, name: str) -> dict[str, Any]:
    """The checkpoint published to the object store, when one is configured."""
    if (store := storage.checkpoint_store()) is None:
        return {}
    url, uploaded = publish_directory(store, checkpoint, DRAFTS, name)
    return {"checkpoint_url": dg.MetadataValue.path(url), "checkpoint_files_uploaded": uploaded}


def online_states(
    context: dg.AssetExecutionContext,
    draft: "DraftSpec",
    storage: StorageResource,
    target: "TargetModel",
    vllm: VllmResource,
    online: OnlineSettings,
) -> "OnlineStates | None":
    """How this run fetches the draft's states (None: it reads the stored ones): its
    first source's `hidden_states` settings (layer ids, which every source shares, storage
    format, requests) read as that step reads them."""
    if online.hidden_states != "online":
        return None
    from mm_assets.services.online_batches import OnlineStates

    first = REGISTRY[next(iter(draft.sources))]
    extraction = stage_settings(context, first, "hidden_states", ExtractionSettings)
    serving = sources_serving(context, draft, storage, target, vllm, "online")
    return OnlineStates.for_target(target, serving, extraction, online, storage.blobs())


def sources_serving(
    context: dg.AssetExecutionContext,
    draft: "DraftSpec",
    storage: StorageResource,
    target: "TargetModel",
    vllm: VllmResource,
    purpose: str,
) -> "Serving":
    """One server of the target that may read every source's images (its log named after
    `purpose`)."""
    sources = [REGISTRY[name] for name in draft.sources]
    images = sources_media_root(sources, storage.tables(), storage.root_dir())
    return vllm.serving(target, images, storage.log_path(f"vllm_{purpose}_{context.run.run_id}"))


def training_metadata(job: "SpeculatorJob", outcome: "SpeculatorOutcome") -> dict[str, Any]:
    from mm_assets.domain.model.families import FAMILIES

    result = outcome.result
    started = {"init_from": job.init.given, "init_sha256": job.init.sha256} if job.init else {}
    return started | {
        "checkpoint": dg.MetadataValue.path(str(outcome.checkpoint)),
        "train_rows": outcome.train_rows,
        "held_out_rows": len(outcome.held_out),
        "draft_vocab_size": outcome.config.draft_vocab_size,
        "target_vocab_size": outcome.config.vocab_size,
        "layer_ids": job.layer_ids,
        "final_train_loss": result.epoch_losses[-1] if result.epoch_losses else float("nan"),
        "held_out_loss": result.held_out_loss,
        "held_out_replies": sum(len(replies) for replies in result.held_out_replies.values()),
        "per_position_acceptance_estimate": [round(a, 4) for a in result.held_out_per_position],
        "acceptance_length_estimate": result.held_out_acceptance,
        "untrained_acceptance_length_estimate": outcome.untrained_acceptance,
        "train_tokens_per_s": result.tokens_per_s,
        "resumed_from_epoch": result.resumed_from_epoch,
        "batch_plan_sha256": result.batch_plan_sha256,
        "reused_checkpoint": outcome.reused,
        "kept_epoch": result.kept_epoch,
        "kept_because": result.kept_because,
        "held_out_acceptance_per_epoch": [
            None if a is None else round(a, 4) for a in result.epoch_acceptance
        ],
        "loss_curve": loss_curve(result),
        "vllm_caveats": FAMILIES[job.settings.draft].serving_caveats(job.target_config),
    }
