"""Encoding hidden states into a compact storage format and decoding any stored blob
back to float32 (the formats and the `needed` rule: `hidden_state_format`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mm_assets.domain.model.hidden_state_format import (
    ERROR_KEY,
    FORMAT_TAG,
    FinalLayer,
    StorageDtype,
    StorageFormat,
    needed_positions,
)

FP8_MAX = 448.0


class UnknownFormat(ValueError):
    """A blob this code cannot read (written by a newer mm_assets, or not ours)."""


def _runs(positions: torch.Tensor) -> torch.Tensor:
    """Sorted positions as `[R, 2]` (start, end) runs: a reply is one run, so a few
    pairs per row instead of 4 bytes per supervised token."""
    if positions.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.int32)
    breaks = (positions[1:] != positions[:-1] + 1).nonzero().squeeze(-1) + 1
    starts = torch.cat([positions[:1], positions[breaks]])
    ends = torch.cat([positions[breaks - 1] + 1, positions[-1:] + 1])
    return torch.stack([starts, ends], dim=1).to(torch.int32)


def _positions(runs: torch.Tensor) -> torch.Tensor:
    spans = [torch.arange(int(start), int(end)) for start, end in runs.tolist()]
    return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)


def _fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and bf16 scales, one per row of the last dimension."""
    amax = x.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.bfloat16)
    q = (x.float() / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def encode(
    hidden: torch.Tensor, token_ids: torch.Tensor, fmt: StorageFormat, loss_mask: Sequence[int]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The compact tensors and metadata for `[T, 4, H]` states (not for `native`)."""
    aux, final = hidden[:, :3], hidden[:, 3]
    tensors: dict[str, torch.Tensor] = {"token_ids": token_ids.to(torch.int32)}
    if fmt.final_layer == FinalLayer.NEEDED:
        positions = torch.tensor(needed_positions(loss_mask[: hidden.shape[0]]), dtype=torch.long)
        final = final[positions]
        tensors["final_runs"] = _runs(positions)
    if fmt.dtype == StorageDtype.FP8_E4M3:
        tensors["aux"], tensors["aux_scale"] = _fp8(aux)
        tensors["final"], tensors["final_scale"] = _fp8(final)
    else:
        low = torch.bfloat16 if fmt.dtype == StorageDtype.BF16 else hidden.dtype
        tensors["aux"], tensors["final"] = aux.to(low), final.to(low)
    metadata = {"format": FORMAT_TAG, "dtype": fmt.dtype.value, "final_layer": fmt.final_layer}
    return tensors, metadata


@dataclass
class StoredStates:
    """What training reads from a blob, in float32: auxiliary states at every position,
    layer L at `final_positions` (None: at every position)."""

    aux: torch.Tensor  # [T, 3, H]
    final: torch.Tensor  # [M, H]
    final_positions: torch.Tensor | None  # [M] original positions, or None for all T


def decode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> StoredStates:
    """Either layout back to float32 (`native`: the speculators `hidden_states`)."""
    if "hidden_states" in tensors:
        hidden = tensors["hidden_states"].float()
        return StoredStates(hidden[:, :3], hidden[:, 3], None)
    metadata = metadata or {}
    if metadata.get("format") != FORMAT_TAG:
        raise UnknownFormat(
            f"hidden-states format {metadata.get('format')!r} is not one this mm_assets "
            f"reads (native, or {FORMAT_TAG}); rematerialize hidden_states with this version"
        )
    aux, final = tensors["aux"].float(), tensors["final"].float()
    if "aux_scale" in tensors:
        aux = aux * tensors["aux_scale"].float().unsqueeze(-1)
        final = final * tensors["final_scale"].float().unsqueeze(-1)
    runs = tensors.get("final_runs")
    positions = None if runs is None else _positions(runs)
    return StoredStates(aux, final, positions)


def max_relative_error(hidden: torch.Tensor, stored: StoredStates) -> list[float]:
    """Per layer (3 auxiliary, then L): the largest error of a decoded element, relative
    to the absolute maximum of its (token, layer) row. 0 for an exact copy."""
    original = hidden.float()
    final = original[:, 3]
    if stored.final_positions is not None:
        final = final[stored.final_positions]
    pairs = [(original[:, k], stored.aux[:, k]) for k in range(3)] + [(final, stored.final)]
    errors = []
    for ref, got in pairs:
        if ref.numel() == 0:
            errors.append(0.0)
            continue
        scale = ref.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        errors.append(float(((got - ref).abs() / scale).max()))
    return errors


def stored_error(path: Path | str) -> list[float]:
    """The per-layer decoding error a compact blob recorded when it was written."""
    with safe_open(str(path), framework="pt") as blob:
        metadata = blob.metadata() or {}
    return json.loads(metadata[ERROR_KEY]) if ERROR_KEY in metadata else [0.0] * 4
