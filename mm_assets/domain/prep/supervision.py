"""Which tokens a training row supervises, the reasons for refusing a row, and the check
that a regenerated reply is supervised as exactly the ids the target generated."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import groupby
from typing import TYPE_CHECKING

from mm_assets.domain.rejection import RowRejected

if TYPE_CHECKING:  # transformers is imported where it is used: it takes seconds
    from transformers import PreTrainedTokenizerBase

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TokenizeDropReason(StrEnum):
    NO_SUPERVISED_TOKENS = "no_supervised_tokens"
    TOO_FEW_SUPERVISED_TOKENS = "too_few_supervised_tokens"
    TEMPLATE_ERROR = "template_error"
    RETOKENIZATION_MISMATCH = "retokenization_mismatch"
    SPECIAL_TOKEN_IN_REPLY = "special_token_in_reply"


class TokenizeRejected(RowRejected):
    """A row this stage cannot use, with its reason."""


@dataclass(frozen=True)
class TokenizedRow:
    """One training row: ids, 0/1 loss mask, and how much of the conversation it covers."""

    input_ids: list[int]
    loss_mask: list[int]
    num_turns: int  # the row covers turns[:num_turns]
    num_images: int  # images inside those turns
    truncated: bool
    position_ids: list[int] | None = None
    """The target's positions of the tokens where they are not 0..n-1 (`positions.py`)."""

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


def control_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokenizer's special tokens: the named ones (BOS, EOS, …) and every added token
    marked special (Llama-3-style tokenizers name few of their turn markers)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}


def mask_from_spans(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """1 for each token whose character range overlaps a supervised span."""
    mask = []
    for start, end in offsets:
        hit = any(
            (start < s_end and end > s_start) if end > start else s_start <= start < s_end
            for s_start, s_end in spans
        )
        mask.append(int(hit))
    return mask


def without_trailing(ids: Sequence[int], special_ids: set[int]) -> list[int]:
    """`ids` without the special tokens at their end (the stop token a reply ends with;
    the template writes its own)."""
    out = list(ids)
    while out and out[-1] in special_ids:
        out.pop()
    return out


def supervised_runs(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """The [start, end) spans of consecutive supervised tokens, in order."""
    runs, start = [], None
    for position, flag in enumerate([*loss_mask, 0]):
        if flag and start is None:
            start = position
        elif not flag and start is not None:
            runs.append((start, position))
            start = None
    return runs


def check_generated_ids(
    row: TokenizedRow, replies: Sequence[tuple[int, Sequence[int]]], special_ids: set[int]
) -> int:
    """The trainer must see exactly the tokens the target generated: each supervised run
    of the row must begin with its reply's ids (`replies`: (turn index, generated ids)),
    without the stop token the template writes itself. A template whose re-tokenization
    of the decoded text differs is refused. Returns the number of replies checked."""
    covered = [
        without_trailing(ids, special_ids) for index, ids in replies if index < row.num_turns
    ]
    runs = supervised_runs(row.loss_mask)
    if len(runs) > len(covered):
        raise TokenizeRejected(
            TokenizeDropReason.RETOKENIZATION_MISMATCH,
            f"{len(runs)} supervised spans for {len(covered)} generated replies",
        )
    last = covered[len(covered) - len(runs) :]
    for n, ((start, end), ids) in enumerate(zip(runs, last, strict=True)):
        got = row.input_ids[start:end]
        cut = row.truncated and end == len(row.input_ids)
        expected = ids[: len(got)] if cut else ids
        if got[: len(expected)] != expected:
            raise TokenizeRejected(
                TokenizeDropReason.RETOKENIZATION_MISMATCH,
                f"reply {n}: {first_mismatch(got, expected)}",
            )
    return len(runs)


def first_mismatch(got: Sequence[int], expected: Sequence[int]) -> str:
    for position, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return f"token {position}: template gives {a}, the target generated {b}"
    return f"template gives {len(got)} tokens, the target generated {len(expected)}"


def render_supervision(
    tokenizer: PreTrainedTokenizerBase,
    ids: Sequence[int],
    mask: Sequence[int],
    image_token_id: int | None = None,
) -> str:
    """Decoded text with supervised spans in ⟦…⟧ and image blocks collapsed, for the UI."""
    pieces: list[str] = []
    pairs = zip(ids, mask, strict=True)
    for kind, run in groupby(pairs, lambda pair: "image" if pair[0] == image_token_id else pair[1]):
        tokens = [token for token, _ in run]
        if kind == "image":
            pieces.append(f"<image ×{len(tokens)}>")
        else:
            text = tokenizer.decode(tokens, skip_special_tokens=False)
            pieces.append(f"⟦{text}⟧" if kind else text)
    return "".join(pieces)
