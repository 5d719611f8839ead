"""Training data for the EAGLE-3 draft: tokenized rows joined with their hidden states,
split into train and held-out sets by a hash of the row id (stable when rows are added
or reordered), packed, and read batch by batch so memory stays bounded by one batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
from safetensors import safe_open

from mm_assets.domain.model.hidden_state_codec import StoredStates, decode
from mm_assets.domain.model.hidden_state_format import needed_positions
from mm_assets.domain.model.hidden_states import LAYER_CONVENTION


class LayerMismatch(ValueError):
    pass


SAMPLE_COLUMNS = ["row_id", "input_ids", "loss_mask", "position_ids"]
"""What a `SampleRef` reads of a `tokenized_samples` row."""


@dataclass(frozen=True)
class SampleRef:
    row_id: str
    path: str
    input_ids: list[int]
    loss_mask: list[int]
    position_ids: list[int] | None = None  # the target's, where not 0..n-1

    @classmethod
    def of(cls, row: dict, path: str) -> SampleRef:
        """The ref of a `tokenized_samples` row whose states are (or will be) at `path`."""
        return cls(row["row_id"], path, row["input_ids"], row["loss_mask"], row["position_ids"])

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def positions(self) -> torch.Tensor:
        """[T] the position the target gives each token."""
        if self.position_ids is None:
            return torch.arange(self.num_tokens)
        return torch.tensor(self.position_ids, dtype=torch.long)


@dataclass(frozen=True)
class Batch:
    """Samples packed along one time axis, pre-shifted (`load_batch`); `segment` tells
    them apart. What the draft's `forward` reads, one object so DDP passes it on whole."""

    input_ids: torch.Tensor  # [N] long
    loss_mask: torch.Tensor  # [N] bool
    aux_hidden: torch.Tensor  # [N, 3 * H] target hidden states at the 3 auxiliary ids
    last_hidden: torch.Tensor  # [M, H] last layer before the final norm, where loss_mask
    position_ids: torch.Tensor  # [N] the target's position of each state (vLLM's to the draft)
    segment: torch.Tensor  # [N] sample index within the batch
    row_ids: list[str] = field(default_factory=list)  # segment -> row

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device) -> Batch:
        names = ("input_ids", "loss_mask", "aux_hidden", "last_hidden", "position_ids", "segment")
        return replace(self, **{name: getattr(self, name).to(device) for name in names})


def check_layer_ids(manifest_rows: Iterable[dict], expected: Sequence[int]) -> None:
    """Refuse hidden states generated for other layer ids or another convention: training
    on them silently collapses acceptance."""
    for row in manifest_rows:
        if list(row["layer_ids"]) != list(expected) or row["layer_convention"] != LAYER_CONVENTION:
            raise LayerMismatch(
                f"hidden states for row {row['row_id']} were generated with layer ids "
                f"{list(row['layer_ids'])} ({row['layer_convention']}), but the draft is "
                f"built for {list(expected)} ({LAYER_CONVENTION}); rematerialize "
                "hidden_states with the same layer_ids as training"
            )


def is_held_out(row_id: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split(refs: Sequence[SampleRef], fraction: float, seed: int) -> tuple[list, list]:
    train = [r for r in refs if not is_held_out(r.row_id, fraction, seed)]
    held_out = [r for r in refs if is_held_out(r.row_id, fraction, seed)]
    if not train:
        raise ValueError("no training rows left after the held-out split")
    return train, held_out


def pack(refs: Sequence[SampleRef], batch_tokens: int) -> list[list[SampleRef]]:
    """Greedy packing in the given order; a row longer than the budget is a batch alone."""
    batches: list[list[SampleRef]] = []
    current: list[SampleRef] = []
    used = 0
    for ref in refs:
        if current and used + ref.num_tokens > batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(ref)
        used += ref.num_tokens
    if current:
        batches.append(current)
    return batches


def read_states(path: str) -> StoredStates:
    """A blob in any format this code knows, decoded to float32 (see hidden_state_format)."""
    with safe_open(path, framework="pt") as blob:
        tensors = {name: blob.get_tensor(name) for name in blob.keys()}  # noqa: SIM118 (not iterable)
        return decode(tensors, blob.metadata())


def final_states(stored: StoredStates, ref: SampleRef) -> torch.Tensor:
    """Layer L at the positions 1..T-1 the (shifted) loss reads, in order; refused when
    the blob kept other positions (stored for another loss mask)."""
    wanted = torch.tensor(needed_positions(ref.loss_mask), dtype=torch.long)
    wanted = wanted[(wanted >= 1) & (wanted < ref.num_tokens)]
    kept = stored.final_positions
    if kept is None:
        return stored.final[wanted]
    rows = torch.searchsorted(kept, wanted).clamp(max=max(len(kept) - 1, 0))
    if len(wanted) and (len(kept) == 0 or not torch.equal(kept[rows], wanted)):
        raise ValueError(
            f"{ref.path} keeps layer L at other positions than row {ref.row_id}'s loss mask "
            "reads (stored with final_layer=needed for another mask); rematerialize "
            "hidden_states"
        )
    return stored.final[rows]


def load_batch(refs: Sequence[SampleRef]) -> Batch:
    """Read and shift each sample as EAGLE-3 training expects: the draft at position t
    reads the target's state at t and token t+1, so tokens and the mask drop their first
    entry, auxiliary states their last, and positions (those of the states, as vLLM
    serves them) their last. Layer L is kept only where the shifted mask is set (all the
    loss reads), whatever the blob's format."""
    ids, masks, aux, last, pos, seg = [], [], [], [], [], []
    for index, ref in enumerate(refs):
        stored = read_states(ref.path)
        n = ref.num_tokens
        ids.append(torch.tensor(ref.input_ids[1:], dtype=torch.long))
        masks.append(torch.tensor(ref.loss_mask[1:], dtype=torch.bool))
        aux.append(stored.aux[: n - 1].reshape(n - 1, -1))
        last.append(final_states(stored, ref))
        pos.append(ref.positions()[: n - 1])
        seg.append(torch.full((n - 1,), index))
    tensors = (torch.cat(parts) for parts in (ids, masks, aux, last, pos, seg))
    return Batch(*tensors, [ref.row_id for ref in refs])
