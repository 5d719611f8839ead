"""Target responses: the conversations training reads, with every assistant turn written
by the target itself (`responses: target` in the registry) or as the dataset wrote it."""

from typing import TYPE_CHECKING, Any

import dagster as dg

from mm_assets.assets.checks import quarantine_ratio, quarantine_ratio_spec
from mm_assets.assets.config import config_class, stage_settings
from mm_assets.assets.metadata import (
    length_histogram,
    quarantine_metadata,
    rounded,
    servers_table,
    table_links,
)
from mm_assets.assets.partitions import accelerator_asset, dataset_spec
from mm_assets.assets.prep import normalized_conversations
from mm_assets.assets.resources import StorageResource, TargetModelResource, VllmResource
from mm_assets.domain.model.responses import ResponseSettings
from mm_assets.services.media import media_root

if TYPE_CHECKING:
    from mm_assets.services.regeneration import RegenerationReport

ResponsesConfig = config_class("ResponsesConfig", "target_responses", ResponseSettings)


@accelerator_asset(
    "1",
    deps=[normalized_conversations],
    kinds={"vllm", "parquet"},
    check_specs=[quarantine_ratio_spec("target_responses", "max_response_quarantine_ratio")],
)
def target_responses(
    context: dg.AssetExecutionContext,
    config: ResponsesConfig,  # type: ignore[valid-type]
    storage: StorageResource,
    target_model: TargetModelResource,
    vllm: VllmResource,
) -> dg.MaterializeResult:
    """The normalized conversations with every assistant turn rewritten by the target
    through vLLM, turn by turn, images included (registry `responses: target`), or passed
    through unchanged (`responses: dataset`, no server). Replies are stored per
    conversation by content key, so reruns ask only for what changed; the token ids the
    target generated are kept. Conversations it cannot answer go to
    `target_responses_quarantine` with their reason."""
    from mm_assets.services.regeneration import TargetRegeneration

    spec, tables = dataset_spec(context), storage.tables()
    settings = stage_settings(context, spec, "target_responses", ResponseSettings)
    target = target_model.model()
    report = TargetRegeneration(
        spec.name,
        tables,
        storage.blobs("responses"),
        target,
        vllm.engine("responses", target),
        settings,
        media_root(spec, tables, storage.root_dir()),
        storage.log_path(f"vllm_responses_{context.run.run_id}"),
    ).run(spec.responses)
    check = quarantine_ratio(report, report.conversations, settings.max_response_quarantine_ratio)
    return dg.MaterializeResult(
        metadata=rounded(
            {**responses_metadata(report), **table_links(tables, "target_responses", spec.name)}
        ),
        data_version=dg.DataVersion(report.kept.content_hash),
        check_results=[check],
    )


def responses_metadata(report: "RegenerationReport") -> dict[str, Any]:
    lengths, requests = report.reply_lengths, report.requests
    metadata: dict[str, Any] = {
        **quarantine_metadata(report),
        "responses": report.mode,
        "conversations": report.conversations,
    }
    if report.mode == "target":
        metadata |= {
            "cache_hits": report.cache_hits,
            "requests_sent": requests.requests_sent,
            "replies": len(lengths),
            "generated_tokens_now": requests.tokens,
            "tokens_per_s": requests.tokens / requests.seconds if requests.seconds else 0.0,
            "mean_reply_tokens": sum(lengths) / max(len(lengths), 1),
            "p95_reply_tokens": sorted(lengths)[int(0.95 * (len(lengths) - 1))] if lengths else 0,
            "length_capped_replies": report.length_capped,
            "conversations_cut_short": report.cut_short,
            "server": report.server,
            "servers": servers_table(requests.servers, requests.seconds),
            "server_startup_s": requests.startup_s if requests.startup_s is not None else "n/a",
            "reply_lengths": length_histogram(lengths, "tokens per reply", "replies"),
        }
    return metadata
