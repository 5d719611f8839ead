"""The draft vocabulary: which target tokens the EAGLE-3 draft can propose.

The `size` target tokens most often supervised (ties by token id; unseen ids fill the
rest in id order). As in speculators/vLLM, `d2t[i]` is the offset from draft id `i` to
its target id, and `t2d` a boolean mask over the target vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    selected: torch.Tensor  # target ids, ascending, [draft_vocab_size]
    target_vocab_size: int

    @property
    def size(self) -> int:
        return int(self.selected.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return self.selected - torch.arange(self.size, dtype=torch.long)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.selected] = True
        return mask


def build_draft_vocab(
    frequencies: Mapping[int, int], target_vocab_size: int, size: int
) -> DraftVocab:
    if size <= 0:
        raise ValueError(f"draft vocabulary size must be positive, got {size}")
    size = min(size, target_vocab_size)
    bad = [t for t in frequencies if not 0 <= t < target_vocab_size]
    if bad:
        raise ValueError(
            f"token ids {bad[:5]} are outside the target vocabulary ({target_vocab_size}); "
            "the token frequencies come from a different tokenizer than the target"
        )
    ranked = sorted(frequencies, key=lambda t: (-frequencies[t], t))[:size]
    chosen = set(ranked)
    filler = (t for t in range(target_vocab_size) if t not in chosen)
    while len(ranked) < size:
        ranked.append(next(filler))
    return DraftVocab(torch.tensor(sorted(ranked), dtype=torch.long), target_vocab_size)


def draft_vocab_from_mapping(d2t: torch.Tensor, target_vocab_size: int) -> DraftVocab:
    """The vocabulary a checkpoint's `d2t` describes (round trip of `DraftVocab.d2t`)."""
    selected = d2t.long() + torch.arange(d2t.numel(), dtype=torch.long)
    return DraftVocab(selected, target_vocab_size)
