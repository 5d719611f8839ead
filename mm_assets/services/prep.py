"""Prep: raw rows into normalized conversations (with a quarantine), then into the
target's token ids and loss masks (with a quarantine and supervised-token counts). A
stage's quarantine (`StageReport`) serves regeneration too."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mm_assets.common.progress import Progress
from mm_assets.domain.ingest.images import ImageProbe, ImageStatus
from mm_assets.domain.prep.conversations import (
    DropReason,
    Rejected,
    normalize,
    parse_record,
    to_vllm_messages,
)
from mm_assets.domain.prep.settings import TokenizationSettings
from mm_assets.domain.prep.supervision import (
    TokenizedRow,
    TokenizeRejected,
    check_generated_ids,
    render_supervision,
)
from mm_assets.domain.prep.tokenization import ChatTokenizer
from mm_assets.domain.rejection import RowFailureWatch, RowRejected, failed_on
from mm_assets.domain.row_ids import make_row_id
from mm_assets.registry import DatasetSpec
from mm_assets.storage import TableStore, WrittenTable, schemas
from mm_assets.storage.tables import BatchWriter

logger = logging.getLogger(__name__)
CONVERSATIONS = "target_responses"  # what tokenization reads (see `services/regeneration.py`)


@dataclass
class StageReport:
    kept: WrittenTable | None = None
    quarantine: WrittenTable | None = None
    reasons: Counter[str] = field(default_factory=Counter)

    def reject(
        self,
        out: BatchWriter,
        source_index: int,
        sample_id: str | None,
        record: str,
        exc: RowRejected,
    ) -> None:
        """A dropped row into the quarantine `out`, counted by its reason."""
        self.reasons[exc.reason.value] += 1
        out.write(
            {
                "source_index": source_index,
                "sample_id": sample_id,
                "reason": exc.reason.value,
                "detail": exc.detail,
                "record": record,
            }
        )


def load_probes(tables: TableStore, partition: str) -> dict[str, ImageProbe]:
    """The availability stage's probes, by reference."""
    probes = {}
    for row in tables.iter_rows("coco_image_availability", partition):
        row.pop("referenced_by")
        probes[row["reference"]] = ImageProbe(**{**row, "status": ImageStatus(row["status"])})
    return probes


@dataclass
class NormalizeReport(StageReport):
    categories: Counter[str] = field(default_factory=Counter)
    """A benchmark's kept rows by category (empty for a training dataset)."""


def normalize_partition(spec: DatasetSpec, tables: TableStore) -> NormalizeReport:
    """One row per usable, distinct sample; every dropped row quarantined with its reason.
    A benchmark's rows carry their category (`DatasetSpec.category_of`)."""
    partition = spec.name
    probes = load_probes(tables, partition)
    seen: set[str] = set()
    report = NormalizeReport()
    with (
        tables.writer("normalized_conversations", partition, schemas.NORMALIZED) as kept,
        tables.writer(
            "normalized_conversations_quarantine", partition, schemas.QUARANTINE
        ) as quarantine,
    ):
        progress = Progress(logger.info, "rows", tables.num_rows("raw_dataset", partition))
        for done, row in enumerate(tables.iter_rows("raw_dataset", partition), 1):
            progress.update(done)
            sample_id = None
            try:
                record = parse_record(row["record"], row["parse_error"])
                conv = normalize(
                    record, spec.format, probes, spec.columns, benchmark=spec.is_benchmark
                )
                sample_id = conv.sample_id()
                if sample_id in seen:
                    raise Rejected(DropReason.DUPLICATE_SAMPLE, "same conversation seen earlier")
            except Rejected as exc:
                report.reject(quarantine, row["source_index"], sample_id, row["record"], exc)
                continue
            except Exception as exc:
                raise failed_on(f"normalizing source row {row['source_index']}", exc) from exc
            seen.add(sample_id)
            category = None
            if spec.is_benchmark:
                category = spec.category_of(record, row.get("source_file"))
                report.categories[category] += 1
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
                    "category": category,
                }
            )
    report.kept, report.quarantine = kept.result, quarantine.result
    return report


@dataclass
class TokenizeReport(StageReport):
    frequencies: Counter[int] = field(default_factory=Counter)
    lengths: list[int] = field(default_factory=list)
    supervised: int = 0
    truncated: int = 0
    mask_method: str = ""
    conversations: int = 0
    exact_replies: int = 0
    """Regenerated replies whose supervised tokens are exactly what the target generated."""
    spliced_replies: int = 0  # of conversations rebuilt reply by reply (`_on_policy_rows`)
    example: str | None = None
    """One row rendered with its supervised tokens marked (a multimodal one if any)."""

    def count(self, row: TokenizedRow) -> None:
        self.frequencies.update(t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m)
        self.lengths.append(len(row.input_ids))
        self.supervised += row.num_supervised
        self.truncated += row.truncated


def _training_rows(sample: dict, rows: list[TokenizedRow]) -> Iterator[dict[str, Any]]:
    turns = json.loads(sample["turns"])
    for row in rows:
        turn = None if len(rows) == 1 else row.num_turns - 1
        yield {
            "row_id": make_row_id(sample["sample_id"], turn),
            "sample_id": sample["sample_id"],
            "source_index": sample["source_index"],
            "input_ids": row.input_ids,
            "loss_mask": row.loss_mask,
            "seq_len": len(row.input_ids),
            "num_supervised": row.num_supervised,
            "truncated": row.truncated,
            "multimodal": row.num_images > 0,
            "messages": (
                json.dumps(to_vllm_messages(turns[: row.num_turns])) if row.num_images else None
            ),
            "image_hashes": sample["image_hashes"][: row.num_images],
            "position_ids": row.position_ids,
        }


def _on_policy_rows(
    sample: dict, rows: list[TokenizedRow], chat: ChatTokenizer, report: TokenizeReport
) -> list[TokenizedRow]:
    """For conversations the target rewrote, rows whose supervised tokens are exactly the
    ids it generated (see `check_generated_ids`), each after exactly the context it was
    asked in. When the template re-tokenizes a reply differently, the conversation gets
    one row per reply built from those pieces (`ChatTokenizer.reply_rows`): spliced."""
    if sample.get("responses") != "target":
        return rows
    replies = list(zip(sample["reply_turns"], sample["reply_token_ids"], strict=True))
    special = set(chat.special_ids)
    try:
        exact = sum(check_generated_ids(row, replies, special) for row in rows)
    except TokenizeRejected:
        turns = json.loads(sample["turns"])
        sizes = list(zip(sample["image_heights"], sample["image_widths"], strict=True))
        rows = chat.reply_rows(turns, replies, special, sizes)
        for row in rows:
            check_generated_ids(row, replies, special)
        report.spliced_replies += len(rows)
        return rows
    report.exact_replies += exact
    return rows


def tokenize_partition(
    partition: str,
    tables: TableStore,
    chat: ChatTokenizer,
    watch: RowFailureWatch | None = None,
) -> TokenizeReport:
    """Training rows for every normalized conversation, their supervised-token counts
    (`token_frequencies`), and a quarantine of conversations that give no usable row.
    A rejection that dominates the first rows (`watch`: by default, as the default
    `TokenizationSettings` say), or an unknown exception, stops the step instead."""
    if watch is None:
        default = TokenizationSettings()
        watch = RowFailureWatch(
            default.repeated_rejection_rows, default.max_repeated_rejection_share
        )
    report = TokenizeReport(mask_method=chat.mask_method)
    example: TokenizedRow | None = None
    with (
        tables.writer("tokenized_samples", partition, schemas.TOKENIZED) as out,
        tables.writer("tokenized_samples_quarantine", partition, schemas.QUARANTINE) as bad,
    ):
        total = tables.num_rows(CONVERSATIONS, partition)
        progress = Progress(logger.info, "samples", total)
        for done, sample in enumerate(tables.iter_rows(CONVERSATIONS, partition), 1):
            progress.update(done)
            report.conversations += 1
            sizes = list(zip(sample["image_heights"], sample["image_widths"], strict=True))
            where = f"sample {sample['sample_id']} (source row {sample['source_index']})"
            try:
                rows = chat.tokenize(json.loads(sample["turns"]), sizes)
                rows = _on_policy_rows(sample, rows, chat, report)
            except TokenizeRejected as exc:
                watch.observe(exc, where)
                report.reject(
                    bad, sample["source_index"], sample["sample_id"], sample["turns"], exc
                )
                continue
            except Exception as exc:
                raise failed_on(f"tokenizing {where}", exc) from exc
            watch.observe(None)
            out.write_many(_training_rows(sample, rows))
            for row in rows:
                report.count(row)
                if example is None or (row.num_images and not example.num_images):
                    example = row
        watch.check()
    freq_rows = ({"token_id": t, "count": c} for t, c in sorted(report.frequencies.items()))
    tables.write("token_frequencies", partition, freq_rows, schemas.TOKEN_FREQUENCIES)
    report.kept, report.quarantine = out.result, bad.result
    if example is not None:
        report.example = render_supervision(
            chat.tokenizer, example.input_ids, example.loss_mask, chat.image_token_id
        )
    return report
