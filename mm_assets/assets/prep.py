"""Prep stage: normalized conversations, then processor-tokenized training rows."""

from typing import TYPE_CHECKING, Any

import dagster as dg

from mm_assets.assets.checks import has_rows, has_rows_spec, quarantine_ratio, quarantine_ratio_spec
from mm_assets.assets.config import config_class, stage_settings
from mm_assets.assets.ingest import coco_image_availability, raw_dataset
from mm_assets.assets.metadata import (
    counts_table,
    length_histogram,
    length_stats,
    quarantine_metadata,
    rounded,
    table_links,
)
from mm_assets.assets.partitions import dataset_asset, dataset_spec
from mm_assets.assets.resources import StorageResource, TargetModelResource
from mm_assets.domain.prep.settings import TokenizationSettings
from mm_assets.storage import TableStore

if TYPE_CHECKING:
    from mm_assets.services.prep import TokenizeReport

ALL_QUARANTINED = (
    "Every row was quarantined: read the reasons in normalized_conversations_quarantine "
    "(a wrong `format` in the registry entry, or images missing under the image root)."
)


@dataset_asset(
    "prep",
    code_version="5",  # 5: image parts carry their probe's hash, checked when sent inline
    deps=[raw_dataset, coco_image_availability],
    check_specs=[has_rows_spec("normalized_conversations", ALL_QUARANTINED)],
)
def normalized_conversations(
    context: dg.AssetExecutionContext, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per usable sample in the normalized conversation form, with a stable
    `sample_id` and its images; every dropped row goes to the quarantine table
    (`normalized_conversations_quarantine`) with its reason and original record. A
    benchmark's rows need no reply and carry their category (`rows_by_category`)."""
    from mm_assets.services.prep import normalize_partition

    spec, tables = dataset_spec(context), storage.tables()
    report = normalize_partition(spec, tables)
    assert report.kept is not None
    by_category = (
        {"rows_by_category": counts_table(report.categories, "category")}
        if spec.is_benchmark
        else {}
    )
    return dg.MaterializeResult(
        metadata={
            **quarantine_metadata(report),
            **by_category,
            **table_links(tables, "normalized_conversations", spec.name),
        },
        data_version=dg.DataVersion(report.kept.content_hash),
        check_results=[has_rows(report.kept.num_rows, ALL_QUARANTINED)],
    )


TokenizationConfig = config_class("TokenizationConfig", "tokenized_samples", TokenizationSettings)


@dataset_asset(
    "prep",
    code_version="4",  # 4: M-RoPE image rows carry the target's positions
    deps=["target_responses"],
    trains=True,
    check_specs=[quarantine_ratio_spec("tokenized_samples", "max_tokenization_quarantine_ratio")],
)
def tokenized_samples(
    context: dg.AssetExecutionContext,
    config: TokenizationConfig,  # type: ignore[valid-type]
    storage: StorageResource,
    target_model: TargetModelResource,
) -> dg.MaterializeResult:
    """Training rows from the target's processor and chat template: `input_ids`,
    assistant-only `loss_mask`, and for multimodal rows the vLLM `messages`. Image tokens
    are counted from header sizes (no pixel is decoded). Supervised-token frequencies go
    to `token_frequencies` for the draft vocabulary. Conversations with no row whose loss
    reads `min_supervised_tokens` tokens besides special tokens go to
    `tokenized_samples_quarantine`; a rejection that dominates the first rows, or an
    unexpected exception, stops the step (a setup problem, not bad rows)."""
    from mm_assets.domain.prep.positions import uses_mrope
    from mm_assets.domain.prep.tokenization import ChatTokenizer
    from mm_assets.domain.rejection import RowFailureWatch
    from mm_assets.services.prep import tokenize_partition

    spec, tables, target = dataset_spec(context), storage.tables(), target_model.model()
    settings = stage_settings(context, spec, "tokenized_samples", TokenizationSettings)
    chat = ChatTokenizer(
        target.load_processor(),
        settings.max_length,
        spec.min_supervised_tokens,
        mrope=uses_mrope(target.config),
    )
    watch = RowFailureWatch(settings.repeated_rejection_rows, settings.max_repeated_rejection_share)
    report = tokenize_partition(spec.name, tables, chat, watch)
    check = quarantine_ratio(report, report.conversations, spec.max_tokenization_quarantine_ratio)
    return dg.MaterializeResult(
        metadata=rounded(tokenization_metadata(report, target.path, tables, spec.name)),
        data_version=dg.DataVersion(report.kept.content_hash),
        check_results=[check],
    )


def tokenization_metadata(
    report: "TokenizeReport", target_path: str, tables: TableStore, partition: str
) -> dict[str, Any]:
    tokens = sum(report.lengths)
    metadata: dict[str, Any] = {
        **quarantine_metadata(report),
        "tokens": tokens,
        "supervised_fraction": report.supervised / max(tokens, 1),
        "truncated_rows": report.truncated,
        "distinct_supervised_tokens": len(report.frequencies),
        "mask_method": report.mask_method,
        "token_exact_replies": report.exact_replies,
        "spliced_replies": report.spliced_replies,
        "target_model": target_path,
        "token_lengths": length_histogram(report.lengths),
        **length_stats(report.lengths),
        **table_links(tables, "tokenized_samples", partition),
    }
    if report.example is not None:
        metadata["sample_with_loss_mask"] = dg.MetadataValue.md(
            "Supervised tokens are inside ⟦ ⟧.\n\n```\n" + report.example + "\n```"
        )
    return metadata
