"""Encoding hidden states into a compact storage format and decoding any stored blob
back to float32 (the formats and the `needed` rule: `hidden_state_format`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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


# Rows are encoded a block at a time so that the passes over each block (convert, scale,
# round, decode, compare) run in cache instead of streaming a whole layer group through
# memory once per pass; the bytes are the same (BENCHMARKS.md, "fp8 encoder"). Decoding
# is two passes and gains nothing from blocks.
BLOCK_ELEMENTS = 1 << 18  # 1 MiB of float32


def _blocks(x: torch.Tensor) -> list[slice]:
    """`x`'s first dimension cut into blocks of about `BLOCK_ELEMENTS` each."""
    step = max(1, BLOCK_ELEMENTS // max(1, x[:1].numel()))
    return [slice(start, start + step) for start in range(0, x.shape[0], step)]


def _quantize(
    x: torch.Tensor, dtype: StorageDtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`x` in the storage dtype (fp8: with a bf16 scale per row of the last dimension),
    and each row's largest decoding error relative to the row's maximum — computed from
    the very dequantization `decode` does, in the same pass over each block."""
    fp8 = dtype == StorageDtype.FP8_E4M3
    stored = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scale = torch.empty(x.shape[:-1], dtype=torch.bfloat16) if fp8 else None
    error = torch.empty(x.shape[:-1], dtype=torch.float32)
    for rows in _blocks(x):
        block = x[rows].to(torch.float32, copy=True)  # scaled in place below
        amax = torch.maximum(block.amax(dim=-1), block.amin(dim=-1).neg_())  # not `aminmax`: slower
        if scale is not None:
            scale[rows] = torch.where(amax > 0, amax / FP8_MAX, 1.0)
            unit = scale[rows].float().unsqueeze(-1)
            # No clamp: the bf16 scale is at most half a bf16 step (2^-8) below amax / 448,
            # so |x / unit| <= 449.75, which rounds to 448 (only values from 464 would not).
            block.div_(unit)
            stored[rows] = block.to(torch.float8_e4m3fn)
            decoded = fp8_to_float32(stored[rows])
            error[rows] = block.sub_(decoded).abs_().amax(dim=-1).mul_(unit.squeeze(-1))
        else:
            stored[rows] = block
            error[rows] = stored[rows].float().sub_(block).abs_().amax(dim=-1)
        error[rows] /= amax.clamp_min(torch.finfo(torch.float32).tiny)
    return stored, scale, error


# Every e4m3 value by its bit pattern: a table lookup decodes faster than torch's own
# fp8 -> float32 conversion on CPU (BENCHMARKS.md, "a cheaper decode").
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def fp8_to_float32(values: torch.Tensor) -> torch.Tensor:
    """e4m3 values as float32, exactly as `.float()` gives them."""
    return torch.from_numpy(np.take(_FP8_VALUES, values.view(torch.uint8).numpy()))


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
        "format": FORMAT_TAG,
        "dtype": fmt.dtype.value,
        "final_layer": fmt.final_layer.value,
        ERROR_KEY: json.dumps([float(f"{e:.4g}") for e in errors]),
    }
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
    aux, final = tensors["aux"], tensors["final"]
    if "aux_scale" in tensors:
        aux = fp8_to_float32(aux).mul_(tensors["aux_scale"].float().unsqueeze(-1))
        final = fp8_to_float32(final).mul_(tensors["final_scale"].float().unsqueeze(-1))
    else:
        aux, final = aux.float(), final.float()
    runs = tensors.get("final_runs")
    positions = None if runs is None else _positions(runs)
    return StoredStates(aux, final, positions)


def stored_error(path: Path | str) -> list[float]:
    """The per-layer decoding error a compact blob recorded when it was written."""
    with safe_open(str(path), framework="pt") as blob:
        metadata = blob.metadata() or {}
    return json.loads(metadata[ERROR_KEY]) if ERROR_KEY in metadata else [0.0] * 4
