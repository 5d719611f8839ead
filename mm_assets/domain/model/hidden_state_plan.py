"""Which rows of a partition need hidden states, and the manifest rows of what is stored.

A row is keyed by its content, so a row whose blob is stored costs no request (a rerun,
a reordering or an interrupted run sends nothing for unchanged samples), and identical
rows share one request and one blob.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mm_assets.domain.model.hidden_states import LAYER_CONVENTION, HiddenStatesLayout


@dataclass(frozen=True)
class PlannedRow:
    row_id: str
    sample_id: str
    key: str
    num_tokens: int
    num_supervised: int


@dataclass
class Plan:
    rows: list[PlannedRow]
    missing: set[str]  # row ids without a blob

    @property
    def missing_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows if r.row_id in self.missing)

    @property
    def missing_supervised(self) -> int:
        return sum(r.num_supervised for r in self.rows if r.row_id in self.missing)

    @property
    def cache_hits(self) -> int:
        return len(self.rows) - len(self.missing)

    def keys(self) -> dict[str, str]:
        return {r.row_id: r.key for r in self.rows}


def plan_extraction(
    rows: Iterable[dict], layout: HiddenStatesLayout, stored: Callable[[str], bool]
) -> Plan:
    """Each row's key, and which rows have no stored hidden states yet."""
    planned, missing = [], set()
    seen_keys: set[str] = set()
    for row in rows:
        key = layout.key(row["input_ids"], row["image_hashes"] or [], row["loss_mask"])
        supervised = sum(row["loss_mask"])
        planned.append(
            PlannedRow(row["row_id"], row["sample_id"], key, len(row["input_ids"]), supervised)
        )
        if not stored(key) and key not in seen_keys:
            missing.add(row["row_id"])
        seen_keys.add(key)  # identical rows share one blob and one request
    return Plan(planned, missing)


def manifest_rows(
    plan: Plan,
    rejected: set[str],
    layout: HiddenStatesLayout,
    stored: Callable[[str], dict[str, Any] | None],
) -> Iterator[dict]:
    """One row per stored sample: its blob and how it was made (checked by training).
    `stored(key)`: the blob's `path`, `bytes` and `max_rel_error`, or None."""
    for row in plan.rows:
        blob = None if row.row_id in rejected else stored(row.key)
        if blob is None:
            continue
        yield {
            "row_id": row.row_id,
            "sample_id": row.sample_id,
            "blob_key": row.key,
            "num_tokens": row.num_tokens,
            **blob,
            "layer_ids": layout.layer_ids,
            "layer_convention": LAYER_CONVENTION,
            "dtype": layout.dtype,
            "hidden_size": layout.hidden_size,
            "target_fingerprint": layout.target_fingerprint,
            "storage_dtype": layout.storage.dtype.value,
            "final_layer": layout.storage.final_layer.value,
        }


@dataclass
class StoredTotals:
    """Every stored row of the partition (cached or new), as the manifest lists them."""

    rows: int = 0
    tokens: int = 0
    bytes: int = 0
    max_rel_error: list[float] = field(default_factory=lambda: [0.0] * 4)

    def count(self, rows: Iterable[dict]) -> Iterator[dict]:
        for row in rows:
            self.rows += 1
            self.tokens += row["num_tokens"]
            self.bytes += row["bytes"]
            self.max_rel_error = [
                max(a, b) for a, b in zip(self.max_rel_error, row["max_rel_error"], strict=True)
            ]
            yield row

    def bf16_layout_ratio(self, hidden_size: int) -> float:
        """Stored bytes per token over speculators' bf16 layout (4 layers x H x 2 bytes)."""
        return self.bytes / max(self.tokens * 4 * hidden_size * 2, 1)
