"""Model stage: hidden states from a real vLLM server, and the trained EAGLE-3 speculator."""

import json
from pathlib import Path

import dagster as dg

from mm_assets.assets.metadata import acceptance_plot, loss_curve, table_links
from mm_assets.assets.prep import tokenized_samples
from mm_assets.automation import materialize_on_change
from mm_assets.clients.vllm_client import CircuitOpen, HiddenStatesClient
from mm_assets.domain.conversations import first_prompt, to_vllm_messages
from mm_assets.domain.evaluation import measured_acceptance
from mm_assets.domain.extraction import (
    ExtractionReport,
    ExtractionSettings,
    check_disk_budget,
    manifest_rows,
    plan_extraction,
    requests_for,
    run_extraction,
)
from mm_assets.domain.hidden_states import (
    LAYER_CONVENTION,
    default_layer_ids,
    eta_seconds,
    human_bytes,
    validate_layer_ids,
)
from mm_assets.domain.speculator_training import TRAINING_VERSION, train_speculator
from mm_assets.domain.trainer import TrainSettings
from mm_assets.partitions import dataset_partitions, dataset_spec
from mm_assets.resources import StorageResource, TargetModelResource, VllmResource
from mm_assets.storage import TableStore, schemas
from mm_assets.storage.tables import file_hash

REJECTION_CHECK = "token_id_rejections"
# Steps that hold the accelerator (a vLLM server, training) share one pool; its limit is
# the instance's `concurrency.pools` setting (dagster.yaml: one at a time by default).
ACCELERATOR_POOL = "accelerator"


class HiddenStatesConfig(dg.Config):
    layer_ids: list[int] | None = None
    """Three auxiliary layers and the last; default [2, L//2, L-3, L]."""
    concurrency: int = 8
    """Requests in flight across all servers."""
    max_rejection_ratio: float = 0.01
    """The blocking check fails the partition above this share of rejected rows."""
    max_retries: int = 4
    breaker_failures: int = 8
    """Consecutive failed requests (after retries) that stop the step."""
    request_timeout_s: float = 600.0


@dg.asset(
    partitions_def=dataset_partitions,
    automation_condition=materialize_on_change(),
    group_name="model",
    pool=ACCELERATOR_POOL,
    code_version="1",
    kinds={"vllm", "safetensors"},
    deps=[tokenized_samples],
    check_specs=[dg.AssetCheckSpec(REJECTION_CHECK, asset="hidden_states", blocking=True)],
)
def hidden_states(
    context: dg.AssetExecutionContext,
    config: HiddenStatesConfig,
    storage: StorageResource,
    target_model: TargetModelResource,
    vllm: VllmResource,
) -> dg.MaterializeResult:
    """Per-row hidden states `[T, n_layers, H]` of the target, from vLLM's
    `extract_hidden_states` method, stored by content key (target, layer ids, dtype,
    input ids, image hashes) so unchanged rows are never requested twice. vLLM's prompt
    token ids are checked against the stored ones for every row. The manifest table
    `hidden_states_manifest` maps rows to blobs; rejected rows go to
    `hidden_states_rejections` with their reason."""
    spec = dataset_spec(context)
    tables, blobs = storage.tables(), storage.blobs()
    facts = target_model.text_facts()
    layer_ids = validate_layer_ids(
        config.layer_ids or default_layer_ids(facts.num_layers), facts.num_layers
    )
    settings = ExtractionSettings(
        target_model.fingerprint(), layer_ids, facts.hidden_size, vllm.resolved_dtype(facts)
    )
    columns = ["row_id", "sample_id", "input_ids", "image_hashes"]
    plan = plan_extraction(
        tables.iter_rows("tokenized_samples", spec.name, columns), settings, blobs
    )
    needed = check_disk_budget(plan, settings, blobs)
    context.log.info(
        f"{len(plan.rows)} rows: {plan.cache_hits} cached, {len(plan.missing)} to request "
        f"({plan.missing_tokens} tokens, ~{human_bytes(needed)})"
    )

    def progress(report: ExtractionReport, done: int, total: int) -> None:
        rate = report.stored_tokens / max(report.seconds, 1e-9)
        eta = eta_seconds(done, total, report.seconds)
        context.log.info(f"hidden states {done}/{total}: {rate:,.0f} tok/s, ETA {eta:,.0f}s")

    report, startup_s, server_rss = ExtractionReport(), None, None
    requests_sent = 0
    if plan.missing:
        incoming = blobs.incoming_dir()
        log_path = tables.root / "logs" / f"vllm_{context.run.run_id}.log"
        with vllm.session(
            str(target_model.local_dir()),
            layer_ids,
            settings.dtype,
            incoming,
            spec.resolved_image_root(),
            log_path,
        ) as session:
            if session.managed:
                startup_s = session.managed.startup_seconds
                context.log.info(f"vLLM started in {startup_s:.1f}s, log {log_path}")
            client = HiddenStatesClient(
                session.base_urls,
                config.concurrency,
                config.request_timeout_s,
                config.max_retries,
                config.breaker_failures,
                vllm.api_key,
            )
            rows = tables.iter_rows(
                "tokenized_samples", spec.name, ["row_id", "input_ids", "messages"]
            )
            try:
                report = run_extraction(
                    client,
                    requests_for(rows, plan.missing),
                    plan,
                    settings,
                    blobs,
                    progress,
                    path_map=vllm.map_path,
                )
            except CircuitOpen as exc:
                raise dg.Failure(
                    f"vLLM stopped answering: {exc}. Samples stored so far are kept; "
                    "rerun to resume."
                ) from exc
            finally:
                requests_sent = client.requests_sent
            if session.managed:
                server_rss = session.managed.rss_bytes()
        if not any(incoming.iterdir()):
            incoming.rmdir()

    rejected = {r["row_id"] for r in report.rejections}
    rows = manifest_rows(plan, rejected, settings, blobs)
    manifest = tables.write("hidden_states_manifest", spec.name, rows, schemas.MANIFEST)
    tables.write("hidden_states_rejections", spec.name, report.rejections, schemas.REJECTIONS)

    ratio = len(rejected) / max(len(plan.rows), 1)
    reasons: dict[str, int] = {}
    for r in report.rejections:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    first = "; ".join(
        f"{r['row_id']}: {r['reason']} ({r['detail']})" for r in report.rejections[:3]
    )
    return dg.MaterializeResult(
        metadata={
            "rows": manifest.num_rows,
            "cache_hits": plan.cache_hits,
            "requests_sent": requests_sent,
            "stored_now": report.stored,
            "rejected": len(rejected),
            "tokens_generated": report.stored_tokens,
            "bytes_generated": report.stored_bytes,
            "tokens_per_s": report.stored_tokens / report.seconds if report.seconds else 0.0,
            "layer_ids": layer_ids,
            "layer_convention": LAYER_CONVENTION,
            "dtype": settings.dtype,
            "target_fingerprint": settings.target_fingerprint,
            "server": "managed" if vllm.managed else ", ".join(vllm.base_urls),
            "server_startup_s": startup_s if startup_s is not None else "n/a",
            "server_rss_mb": round(server_rss / 2**20) if server_rss else "n/a",
            **table_links(tables, "hidden_states_manifest", spec.name),
            "blobs": dg.MetadataValue.path(str(blobs.dir)),
        },
        data_version=dg.DataVersion(manifest.content_hash),
        check_results=[
            dg.AssetCheckResult(
                check_name=REJECTION_CHECK,
                passed=ratio <= config.max_rejection_ratio,
                description=(
                    f"{len(rejected)}/{len(plan.rows)} rows rejected ({ratio:.2%}); allowed "
                    f"{config.max_rejection_ratio:.2%}. "
                    + (f"First: {first}" if first else "")
                    + " Token mismatches mean the stored input_ids differ from what vLLM "
                    "renders: check the chat template and processor match the served model."
                    * bool(reasons.get("token_mismatch"))
                ),
                metadata={
                    "rejection_ratio": ratio,
                    **{f"rejected_{k}": v for k, v in reasons.items()},
                },
            )
        ],
    )


def held_out_prompts(
    tables: TableStore, partition: str, row_ids: set[str], limit: int
) -> list[list[dict]]:
    """Chat prompts (up to the first assistant turn) of held-out samples, images included."""
    sample_ids = {row_id.split("/")[0] for row_id in row_ids}
    prompts = []
    for row in tables.iter_rows("normalized_conversations", partition, ["sample_id", "turns"]):
        if row["sample_id"] in sample_ids and (turns := first_prompt(json.loads(row["turns"]))):
            prompts.append(to_vllm_messages(turns))
            if len(prompts) >= limit:
                break
    return prompts


class SpeculatorConfig(dg.Config):
    epochs: int = 4
    learning_rate: float = 1e-3
    batch_tokens: int = 4096
    """Tokens per packed batch."""
    ttt_steps: int = 3
    """Test-time-training unroll: draft positions trained per root position."""
    step_loss_decay: float = 1.0
    draft_vocab_size: int = 32000
    held_out_fraction: float = 0.1
    seed: int = 0
    layer_ids: list[int] | None = None
    """Must equal the ids the hidden states were generated with (checked)."""
    speculative_tokens: int = 3
    measure_in_vllm: bool = True
    """Serve the target with the trained draft and read vLLM's spec-decode counters."""
    vllm_prompts: int = 32
    vllm_max_tokens: int = 64
    retrain: bool = False
    """Train (and measure) again even when this checkpoint came from identical inputs."""


@dg.asset(
    partitions_def=dataset_partitions,
    automation_condition=materialize_on_change(),
    group_name="model",
    pool=ACCELERATOR_POOL,
    code_version=TRAINING_VERSION,
    kinds={"pytorch", "safetensors"},
    deps=[hidden_states],
)
def trained_speculator(
    context: dg.AssetExecutionContext,
    config: SpeculatorConfig,
    storage: StorageResource,
    target_model: TargetModelResource,
    vllm: VllmResource,
) -> dg.MaterializeResult:
    """An EAGLE-3 draft for the target, trained on this partition's hidden states and
    written in the speculators format vLLM loads (`speculators/<partition>/`). Reports the
    held-out loss, per-position conditional accuracy and estimated acceptance length, and
    — with `measure_in_vllm` — the acceptance vLLM measures serving the target with it.
    A rerun whose inputs and settings are unchanged reuses the checkpoint and its
    measurement instead of training again (`retrain` forces it)."""
    spec = dataset_spec(context)
    tables, root = storage.tables(), Path(storage.root)
    facts = target_model.text_facts()
    job = target_model.speculator_job(
        spec.name,
        root,
        TrainSettings(
            epochs=config.epochs,
            learning_rate=config.learning_rate,
            batch_tokens=config.batch_tokens,
            ttt_steps=config.ttt_steps,
            step_loss_decay=config.step_loss_decay,
            seed=config.seed,
        ),
        config.layer_ids,
        config.draft_vocab_size,
        config.held_out_fraction,
        config.speculative_tokens,
    )
    outcome = train_speculator(job, tables, context.log.info, reuse=not config.retrain)
    result, out_dir, held_out = outcome.result, outcome.checkpoint, outcome.held_out
    metadata: dict = {
        "checkpoint": dg.MetadataValue.path(str(out_dir)),
        "train_rows": outcome.train_rows,
        "held_out_rows": len(held_out),
        "draft_vocab_size": outcome.config.draft_vocab_size,
        "target_vocab_size": outcome.config.vocab_size,
        "layer_ids": job.layer_ids,
        "final_train_loss": result.epoch_losses[-1] if result.epoch_losses else float("nan"),
        "held_out_loss": result.held_out_loss,
        "held_out_conditional_accuracy": [round(a, 4) for a in result.held_out_accuracy],
        "acceptance_length_estimate": result.held_out_acceptance,
        "untrained_acceptance_length_estimate": outcome.untrained_acceptance,
        "train_tokens_per_s": result.tokens_per_s,
        "resumed_from_epoch": result.resumed_from_epoch,
        "reused_checkpoint": outcome.reused,
        "loss_curve": loss_curve(result.batch_losses, result.epoch_losses, result.held_out_loss),
    }
    weights_sha256 = outcome.weights_sha256 or file_hash(out_dir / "model.safetensors")
    vllm_rates = None
    if config.measure_in_vllm and held_out:
        prompts = held_out_prompts(
            tables, spec.name, {r.row_id for r in held_out}, config.vllm_prompts
        )
        measured = measured_acceptance(
            str(job.target_dir),
            out_dir,
            weights_sha256,
            prompts,
            spec.resolved_image_root(),
            root / "logs" / f"vllm_spec_{context.run.run_id}.log",
            vllm.engine_options(vllm.resolved_dtype(facts)),
            config.speculative_tokens,
            config.vllm_max_tokens,
            reuse=not config.retrain,
        )
        vllm_rates = measured.per_position
        metadata.update(
            {
                "vllm_acceptance_length": measured.acceptance_length,
                "vllm_per_position_acceptance": [round(r, 4) for r in vllm_rates],
                "vllm_drafts": measured.drafts,
                "vllm_prompts": len(prompts),
                "vllm_measurement_reused": measured.reused,
            }
        )
    metadata["per_position_acceptance"] = acceptance_plot(result.held_out_accuracy, vllm_rates)
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(weights_sha256))
