"""Prep stage: normalized conversations, then processor-tokenized training rows."""

import json
from collections import Counter

import dagster as dg

from mm_assets.assets.ingest import coco_image_availability, raw_dataset
from mm_assets.assets.metadata import counts_table, length_histogram, length_stats, table_links
from mm_assets.automation import materialize_on_change
from mm_assets.domain.conversations import (
    DropReason,
    Rejected,
    normalize,
    parse_record,
    to_vllm_messages,
)
from mm_assets.domain.images import ImageProbe, ImageStatus
from mm_assets.domain.progress import Progress
from mm_assets.domain.tokenization import ChatTokenizer, TokenizeRejected, render_supervision
from mm_assets.partitions import dataset_partitions, dataset_spec
from mm_assets.resources import StorageResource, TargetModelResource
from mm_assets.storage import schemas


def _load_probes(storage: StorageResource, partition: str) -> dict[str, ImageProbe]:
    probes = {}
    for row in storage.tables().iter_rows("coco_image_availability", partition):
        row.pop("referenced_by")
        probes[row["reference"]] = ImageProbe(**{**row, "status": ImageStatus(row["status"])})
    return probes


@dg.asset(
    partitions_def=dataset_partitions,
    automation_condition=materialize_on_change(),
    group_name="prep",
    code_version="1",
    kinds={"parquet"},
    deps=[raw_dataset, coco_image_availability],
)
def normalized_conversations(
    context: dg.AssetExecutionContext, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per usable sample in the normalized conversation form, with a stable
    `sample_id` and its images; every dropped row goes to the quarantine table
    (`normalized_conversations_quarantine`) with its reason and original record."""
    spec = dataset_spec(context)
    tables = storage.tables()
    probes = _load_probes(storage, spec.name)
    seen: set[str] = set()
    reasons: Counter[str] = Counter()
    with (
        tables.writer("normalized_conversations", spec.name, schemas.NORMALIZED) as kept,
        tables.writer(
            "normalized_conversations_quarantine", spec.name, schemas.QUARANTINE
        ) as quarantine,
    ):
        progress = Progress(context.log.info, "rows", tables.num_rows("raw_dataset", spec.name))
        for done, row in enumerate(tables.iter_rows("raw_dataset", spec.name), 1):
            progress.update(done)
            sample_id = None
            try:
                conv = normalize(
                    parse_record(row["record"], row["parse_error"]), spec.format, probes
                )
                sample_id = conv.sample_id()
                if sample_id in seen:
                    raise Rejected(DropReason.DUPLICATE_SAMPLE, "same conversation seen earlier")
            except Rejected as exc:
                reasons[exc.reason.value] += 1
                quarantine.write(
                    {
                        "source_index": row["source_index"],
                        "sample_id": sample_id,
                        "reason": exc.reason.value,
                        "detail": exc.detail,
                        "record": row["record"],
                    }
                )
                continue
            seen.add(sample_id)
            kept.write(
                {
                    "sample_id": sample_id,
                    "source_index": row["source_index"],
                    "turns": json.dumps(conv.turns, ensure_ascii=False),
                    "multimodal": conv.multimodal,
                    "image_paths": [p.path for p in conv.images],
                    "image_hashes": [p.content_hash for p in conv.images],
                    "image_heights": [p.height for p in conv.images],
                    "image_widths": [p.width for p in conv.images],
                }
            )
    assert kept.result is not None and quarantine.result is not None
    return dg.MaterializeResult(
        metadata={
            "rows": kept.result.num_rows,
            "quarantined": quarantine.result.num_rows,
            "drop_reasons": counts_table(reasons, "reason"),
            **table_links(tables, "normalized_conversations", spec.name),
            "quarantine_path": dg.MetadataValue.path(str(quarantine.result.path)),
        },
        data_version=dg.DataVersion(kept.result.content_hash),
    )


class TokenizationConfig(dg.Config):
    max_length: int = 4096
    """Rows are cut to this many tokens, never inside an image-token block."""


@dg.asset(
    partitions_def=dataset_partitions,
    automation_condition=materialize_on_change(),
    group_name="prep",
    code_version="1",
    kinds={"parquet"},
    deps=[normalized_conversations],
)
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
    spec = dataset_spec(context)
    tables = storage.tables()
    chat = ChatTokenizer(target_model.load_processor(), max_length=config.max_length)
    frequencies: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    lengths: list[int] = []
    supervised = truncated = 0
    example = None
    with (
        tables.writer("tokenized_samples", spec.name, schemas.TOKENIZED) as out,
        tables.writer("tokenized_samples_quarantine", spec.name, schemas.QUARANTINE) as quarantine,
    ):
        total = tables.num_rows("normalized_conversations", spec.name)
        progress = Progress(context.log.info, "samples", total)
        for done, sample in enumerate(tables.iter_rows("normalized_conversations", spec.name), 1):
            progress.update(done)
            turns = json.loads(sample["turns"])
            sizes = list(zip(sample["image_heights"], sample["image_widths"], strict=True))
            try:
                rows = chat.tokenize(turns, sizes)
            except TokenizeRejected as exc:
                reasons[exc.reason.value] += 1
                quarantine.write(
                    {
                        "source_index": sample["source_index"],
                        "sample_id": sample["sample_id"],
                        "reason": exc.reason.value,
                        "detail": exc.detail,
                        "record": sample["turns"],
                    }
                )
                continue
            for row in rows:
                row_id = (
                    sample["sample_id"]
                    if len(rows) == 1
                    else (f"{sample['sample_id']}/turn{row.num_turns - 1}")
                )
                used = turns[: row.num_turns]
                out.write(
                    {
                        "row_id": row_id,
                        "sample_id": sample["sample_id"],
                        "source_index": sample["source_index"],
                        "input_ids": row.input_ids,
                        "loss_mask": row.loss_mask,
                        "seq_len": len(row.input_ids),
                        "num_supervised": row.num_supervised,
                        "truncated": row.truncated,
                        "multimodal": row.num_images > 0,
                        "messages": json.dumps(to_vllm_messages(used)) if row.num_images else None,
                        "image_hashes": sample["image_hashes"][: row.num_images],
                    }
                )
                frequencies.update(
                    t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m
                )
                lengths.append(len(row.input_ids))
                supervised += row.num_supervised
                truncated += row.truncated
                if example is None or (row.num_images and not example[2]):
                    example = (row.input_ids, row.loss_mask, row.num_images)
    freq_rows = ({"token_id": t, "count": c} for t, c in sorted(frequencies.items()))
    tables.write("token_frequencies", spec.name, freq_rows, schemas.TOKEN_FREQUENCIES)
    assert out.result is not None and quarantine.result is not None
    metadata = {
        "rows": out.result.num_rows,
        "quarantined": quarantine.result.num_rows,
        "drop_reasons": counts_table(reasons, "reason"),
        "tokens": sum(lengths),
        "supervised_fraction": supervised / max(sum(lengths), 1),
        "truncated_rows": truncated,
        "distinct_supervised_tokens": len(frequencies),
        "mask_method": chat.mask_method,
        "target_model": target_model.path,
        "token_lengths": length_histogram(lengths),
        **length_stats(lengths),
        **table_links(tables, "tokenized_samples", spec.name),
        "quarantine_path": dg.MetadataValue.path(str(quarantine.result.path)),
    }
    if example is not None:
        text = render_supervision(chat.tokenizer, example[0], example[1], chat.image_token_id)
        metadata["sample_with_loss_mask"] = dg.MetadataValue.md(
            "Supervised tokens are inside ⟦ ⟧.\n\n```\n" + text + "\n```"
        )
    return dg.MaterializeResult(
        metadata=metadata, data_version=dg.DataVersion(out.result.content_hash)
    )
