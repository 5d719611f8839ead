"""Prep stage: normalized conversations, then processor-tokenized training rows."""

import dagster as dg

from mm_assets.assets.ingest import coco_image_availability, raw_dataset
from mm_assets.assets.metadata import (
    length_histogram,
    length_stats,
    quarantine_metadata,
    table_links,
)
from mm_assets.assets.partitions import dataset_asset, dataset_spec
from mm_assets.assets.resources import StorageResource, TargetModelResource


@dataset_asset("prep", code_version="2", deps=[raw_dataset, coco_image_availability])
def normalized_conversations(
    context: dg.AssetExecutionContext, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per usable sample in the normalized conversation form, with a stable
    `sample_id` and its images; every dropped row goes to the quarantine table
    (`normalized_conversations_quarantine`) with its reason and original record."""
    from mm_assets.services.prep import normalize_partition

    spec, tables = dataset_spec(context), storage.tables()
    report = normalize_partition(spec.name, spec.format, tables, context.log.info)
    assert report.kept is not None
    return dg.MaterializeResult(
        metadata={
            **quarantine_metadata(report.kept, report.quarantine, report.reasons),
            **table_links(tables, "normalized_conversations", spec.name),
        },
        data_version=dg.DataVersion(report.kept.content_hash),
    )


class TokenizationConfig(dg.Config):
    max_length: int = 4096
    """Rows are cut to this many tokens, never inside an image-token block."""


@dataset_asset("prep", code_version="2", deps=["target_responses"])
def tokenized_samples(
    context: dg.AssetExecutionContext,
    config: TokenizationConfig,
    storage: StorageResource,
    target_model: TargetModelResource,
) -> dg.MaterializeResult:
    """Training rows from the target's processor and chat template: `input_ids`,
    assistant-only `loss_mask`, and for multimodal rows the vLLM `messages`. Image tokens
    are counted from header sizes (no pixel is decoded). Supervised-token frequencies go
    to `token_frequencies` for the draft vocabulary; rows without a supervised token go
    to `tokenized_samples_quarantine`."""
    from mm_assets.domain.prep.tokenization import ChatTokenizer
    from mm_assets.services.prep import tokenize_partition

    tables, target = storage.tables(), target_model.model()
    chat = ChatTokenizer(target.load_processor(), max_length=config.max_length)
    report = tokenize_partition(context.partition_key, tables, chat, context.log.info)
    assert report.kept is not None
    tokens = sum(report.lengths)
    metadata = {
        **quarantine_metadata(report.kept, report.quarantine, report.reasons),
        "tokens": tokens,
        "supervised_fraction": report.supervised / max(tokens, 1),
        "truncated_rows": report.truncated,
        "distinct_supervised_tokens": len(report.frequencies),
        "mask_method": report.mask_method,
        "token_exact_replies": report.exact_replies,
        "spliced_replies": report.spliced_replies,
        "target_model": target.path,
        "token_lengths": length_histogram(report.lengths),
        **length_stats(report.lengths),
        **table_links(tables, "tokenized_samples", context.partition_key),
    }
    if report.example is not None:
        metadata["sample_with_loss_mask"] = dg.MetadataValue.md(
            "Supervised tokens are inside ⟦ ⟧.\n\n```\n" + report.example + "\n```"
        )
    return dg.MaterializeResult(
        metadata=metadata, data_version=dg.DataVersion(report.kept.content_hash)
    )
