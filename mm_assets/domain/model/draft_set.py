"""The training set of a draft trained on several datasets (its sources).

From each source's rows with stored hidden states: the cap (a row count or a fraction,
chosen by a seeded hash of the row id, so a row added to the source changes the choice
by at most one row), then one copy of each conversation several sources hold (the first
source listed keeps it), then each source's held-out rows, at least `min_held_out` per
source when there are several, so each is measured. Row ids are prefixed with their
source (`source:row_id`). A dataset's own draft is the one-source case.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mm_assets.common.hashing import json_sha256
from mm_assets.domain.model.responses import prompt_side
from mm_assets.domain.model.training_data import SampleRef, is_held_out

SEPARATOR = ":"


def prompt_key(turns: Sequence[Mapping[str, Any]], image_hashes: Sequence[str]) -> str:
    """A conversation's key whatever its replies (two sources may answer it differently)."""
    return json_sha256(prompt_side([dict(t) for t in turns], list(image_hashes)))


@dataclass(frozen=True)
class SourceRows:
    """One source's rows with stored states; `keys`: row id -> its conversation's prompt
    key plus the row's place in it (rows of one conversation, one per reply, differ)."""

    name: str
    refs: Sequence[SampleRef]
    keys: Mapping[str, str]
    max_rows: int | None = None
    fraction: float | None = None


@dataclass
class SourceFigures:
    rows: int = 0  # trained or held out
    capped: int = 0  # left out by the cap
    duplicates: int = 0  # left out: another source listed first holds the conversation
    held_out: int = 0
    tokens: int = 0
    supervised: int = 0


@dataclass
class DraftSet:
    train: list[SampleRef]
    held_out: list[SampleRef]
    frequencies: dict[int, int]
    figures: dict[str, SourceFigures] = field(default_factory=dict)
    duplicates: dict[str, int] = field(default_factory=dict)
    """`kept_by/dropped_from` -> conversations' rows held by both, trained once."""


def source_of(row_id: str) -> tuple[str, str]:
    """(source, the row id in its source) of a draft's row id."""
    source, _, row = row_id.partition(SEPARATOR)
    return source, row


def _rank(seed: int, source: str, row_id: str) -> int:
    digest = hashlib.sha256(f"{seed}:{source}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def capped(source: SourceRows, seed: int) -> list[SampleRef]:
    """The source's rows its cap keeps, in their stored order."""
    if source.max_rows is None and source.fraction is None:
        return list(source.refs)
    ranks = {ref.row_id: _rank(seed, source.name, ref.row_id) for ref in source.refs}
    if source.fraction is not None:
        return [r for r in source.refs if ranks[r.row_id] / 2**64 < source.fraction]
    kept = set(sorted(ranks, key=ranks.__getitem__)[: source.max_rows])
    return [r for r in source.refs if r.row_id in kept]


def draft_set(
    sources: Sequence[SourceRows], held_out_fraction: float, seed: int, min_held_out: int = 16
) -> DraftSet:
    """The draft's rows: capped, one copy per conversation, held out per source.
    Without `keys` (a source alone has no other to share a conversation with), nothing
    is a duplicate."""
    out = DraftSet([], [], {})
    minimum = min_held_out if len(sources) > 1 else 0
    owner: dict[str, str] = {}  # prompt key -> the source that keeps it
    for source in sources:
        figures = out.figures[source.name] = SourceFigures()
        kept = capped(source, seed)
        figures.capped = len(source.refs) - len(kept)
        mine = []
        for ref in kept:
            key = source.keys.get(ref.row_id)
            if key is not None and owner.get(key, source.name) != source.name:
                figures.duplicates += 1
                pair = f"{owner[key]}/{source.name}"
                out.duplicates[pair] = out.duplicates.get(pair, 0) + 1
                continue
            if key is not None:
                owner[key] = source.name
            mine.append(ref)
        held = _held_out(mine, held_out_fraction, seed, minimum)
        named = [dataclasses.replace(r, row_id=f"{source.name}{SEPARATOR}{r.row_id}") for r in mine]
        out.train += [n for r, n in zip(mine, named, strict=True) if r.row_id not in held]
        out.held_out += [n for r, n in zip(mine, named, strict=True) if r.row_id in held]
        _count(figures, mine, len(held))
    counts: Counter[int] = Counter()
    for ref in out.train + out.held_out:
        counts.update(t for t, m in zip(ref.input_ids, ref.loss_mask, strict=True) if m)
    out.frequencies = dict(counts)
    return out


def _held_out(refs: list[SampleRef], fraction: float, seed: int, minimum: int) -> set[str]:
    """The held-out rule on the row ids within the source; topped up to `minimum` (while
    a row is left to train on) by the same hash, so the choice stays stable."""
    held = {r.row_id for r in refs if is_held_out(r.row_id, fraction, seed)}
    want = min(minimum, max(len(refs) - 1, 0)) if fraction > 0 else 0
    if len(held) < want:
        order = sorted(
            (r.row_id for r in refs if r.row_id not in held),
            key=lambda row: hashlib.sha256(f"{seed}:{row}".encode()).digest(),
        )
        held.update(order[: want - len(held)])
    return held


def _count(figures: SourceFigures, refs: list[SampleRef], held_out: int) -> None:
    figures.rows, figures.held_out = len(refs), held_out
    figures.tokens = sum(r.num_tokens for r in refs)
    figures.supervised = sum(sum(r.loss_mask) for r in refs)
