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


def _quantize(
    x: torch.Tensor, dtype: StorageDtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`x` in the storage dtype (fp8: with a bf16 scale per row of the last dimension),
    and each row's largest decoding error relative to the row's maximum — computed from
    the very dequantization `decode` does, in the same pass.

    Written for a real width (a 1000-token row at H=3584 is 43 MB per layer group):
    one scratch tensor updated in place, because allocating fresh ones costs more than
    the arithmetic (2x faster than the plain expression on one thread, measured)."""
    x = x.float()
    amax = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg())
    if dtype == StorageDtype.FP8_E4M3:
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.bfloat16)
        unit = scale.float().unsqueeze(-1)
        scratch = torch.div(x, unit).clamp_(-FP8_MAX, FP8_MAX)
        stored = scratch.to(torch.float8_e4m3fn)
        # |decoded - x| = unit * |stored - x / unit|, clamping included
        torch.div(x, unit, out=scratch)
        error = scratch.sub_(stored.float()).abs_().amax(dim=-1) * unit.squeeze(-1)
    else:
        scale, stored = None, x.to(torch.bfloat16)
        error = stored.float().sub_(x).abs_().amax(dim=-1)
    return stored, scale, error / amax.clamp_min(torch.finfo(torch.float32).tiny)


def encode(
    hidden: torch.Tensor, token_ids: torch.Tensor, fmt: StorageFormat, loss_mask: Sequence[int]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The compact tensors and metadata for `[T, 4, H]` states (not for `native`); the
    metadata records the largest decoding error per layer (`ERROR_KEY`)."""
    if fmt.dtype == StorageDtype.NATIVE:
        raise ValueError("native states are stored as received, not encoded")
    aux, final = hidden[:, :3], hidden[:, 3]
    tensors: dict[str, torch.Tensor] = {"token_ids": token_ids.to(torch.int32)}
    if fmt.final_layer == FinalLayer.NEEDED:
        positions = torch.tensor(needed_positions(loss_mask[: hidden.shape[0]]), dtype=torch.long)
        final = final[positions]
        tensors["final_runs"] = _runs(positions)
    tensors["aux"], aux_scale, aux_error = _quantize(aux, fmt.dtype)
    tensors["final"], final_scale, final_error = _quantize(final, fmt.dtype)
    if aux_scale is not None and final_scale is not None:
        tensors["aux_scale"], tensors["final_scale"] = aux_scale, final_scale
    errors = [*aux_error.amax(dim=0).tolist(), float(final_error.max()) if final.numel() else 0.0]
    metadata = {
        "format": FORMAT_TAG, "dtype": fmt.dtype.value, "final_layer": fmt.final_layer.value,
        ERROR_KEY: json.dumps([float(f"{e:.4g}") for e in errors]),
    }  # fmt: skip
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


def stored_error(path: Path | str) -> list[float]:
    """The per-layer decoding error a compact blob recorded when it was written."""
    with safe_open(str(path), framework="pt") as blob:
        metadata = blob.metadata() or {}
    return json.loads(metadata[ERROR_KEY]) if ERROR_KEY in metadata else [0.0] * 4
