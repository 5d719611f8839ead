"""Model stage: hidden states from a real vLLM server (and, next, the trained speculator)."""

import dagster as dg

from mm_assets.assets.prep import tokenized_samples
from mm_assets.clients.vllm_client import CircuitOpen, HiddenStatesClient
from mm_assets.domain.extraction import (
    ExtractionReport,
    ExtractionSettings,
    check_disk_budget,
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
from mm_assets.partitions import dataset_partitions, dataset_spec
from mm_assets.resources import StorageResource, TargetModelResource, VllmResource
from mm_assets.storage import schemas

REJECTION_CHECK = "token_id_rejections"


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
    group_name="model",
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
    manifest_rows = (
        {
            "row_id": row.row_id,
            "sample_id": row.sample_id,
            "blob_key": row.key,
            "path": str(blobs.path(row.key)),
            "num_tokens": row.num_tokens,
            "bytes": blobs.path(row.key).stat().st_size,
            "layer_ids": layer_ids,
            "layer_convention": LAYER_CONVENTION,
            "dtype": settings.dtype,
            "hidden_size": facts.hidden_size,
            "target_fingerprint": settings.target_fingerprint,
        }
        for row in plan.rows
        if row.row_id not in rejected and blobs.has(row.key)
    )
    manifest = tables.write("hidden_states_manifest", spec.name, manifest_rows, schemas.MANIFEST)
    tables.write("hidden_states_rejections", spec.name, report.rejections, schemas.REJECTIONS)
    tables.refresh_catalog()

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
            "manifest": dg.MetadataValue.path(str(manifest.path)),
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
