"""Row ids of tokenized samples: one function makes them, one reads them back.

A conversation is usually one training row, whose id is its `sample_id`. When its chat
template rewrites history, tokenization emits one row per assistant turn, and the row
of the turn at index k is `<sample_id>/turn<k>`.
"""

from __future__ import annotations

import re

_PER_TURN = re.compile(r"^(?P<sample>[^/]+)/turn(?P<turn>\d+)$")


def make_row_id(sample_id: str, turn_index: int | None = None) -> str:
    """The row id of a whole conversation (`turn_index` None) or of one assistant turn."""
    if "/" in sample_id:
        raise ValueError(f"sample id {sample_id!r} must not contain '/'")
    return sample_id if turn_index is None else f"{sample_id}/turn{turn_index}"


def sample_id_of(row_id: str) -> str:
    """The conversation a row belongs to."""
    match = _PER_TURN.match(row_id)
    return match["sample"] if match else row_id


def turn_index_of(row_id: str) -> int | None:
    """The assistant turn a per-turn row holds; None for a whole conversation."""
    match = _PER_TURN.match(row_id)
    return int(match["turn"]) if match else None
