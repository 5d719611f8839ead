"""Checking what vLLM returned for a row before it is stored: the prompt token ids it
rendered, and the hidden-states file (keys, shape, dtype, finite values)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum

import torch

from mm_assets.domain.rejection import RowRejected


class HiddenStatesProblem(StrEnum):
    TOKEN_MISMATCH = "token_mismatch"
    BAD_FILE = "bad_file"
    BAD_SHAPE = "bad_shape"
    BAD_DTYPE = "bad_dtype"
    NON_FINITE = "non_finite"
    PATH_OUTSIDE = "hidden_states_path_outside"  # not a file of the step's connector dir


class HiddenStatesRejected(RowRejected):
    """A row this stage cannot use, with its reason."""


def first_difference(a: Sequence[int], b: Sequence[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first difference at position {i}: vLLM {x} vs stored {y}"
    return f"lengths differ: vLLM {len(a)} vs stored {len(b)}"


def check_prompt_ids(prompt_ids: Sequence[int], input_ids: Sequence[int]) -> None:
    """vLLM's rendering must equal ours; a truncated row must be a prefix of it."""
    if list(prompt_ids[: len(input_ids)]) != list(input_ids):
        raise HiddenStatesRejected(
            HiddenStatesProblem.TOKEN_MISMATCH, first_difference(prompt_ids, input_ids)
        )


def validate_tensors(
    tensors: Mapping[str, torch.Tensor],
    input_ids: Sequence[int],
    num_layers: int,
    hidden_size: int,
    dtype: str,
) -> torch.Tensor:
    """The `[T, n_layers, H]` hidden states for `input_ids`, or the reason they are unusable.
    Files covering a longer (untruncated) prompt are cut to the row's length."""
    if set(tensors) != {"hidden_states", "token_ids"}:
        raise HiddenStatesRejected(HiddenStatesProblem.BAD_FILE, f"keys {sorted(tensors)}")
    hidden, token_ids = tensors["hidden_states"], tensors["token_ids"]
    n = len(input_ids)
    if token_ids.ndim != 1 or token_ids.shape[0] < n:
        raise HiddenStatesRejected(
            HiddenStatesProblem.BAD_SHAPE, f"token_ids {tuple(token_ids.shape)} for {n} tokens"
        )
    check_prompt_ids(token_ids.tolist(), input_ids)
    expected = (token_ids.shape[0], num_layers, hidden_size)
    if tuple(hidden.shape) != expected:
        raise HiddenStatesRejected(
            HiddenStatesProblem.BAD_SHAPE, f"hidden_states {tuple(hidden.shape)} != {expected}"
        )
    if hidden.dtype != getattr(torch, dtype):  # a dtype the store knows (`NATIVE_BYTES`)
        raise HiddenStatesRejected(
            HiddenStatesProblem.BAD_DTYPE, f"{hidden.dtype}, expected {dtype}"
        )
    hidden = hidden[:n]
    # NaN and ±inf propagate to the extremes: two reductions instead of a mask of T·4·H
    if not (torch.isfinite(hidden.amax()) and torch.isfinite(hidden.amin())):
        bad = int((~torch.isfinite(hidden)).any(dim=(1, 2)).nonzero()[0])
        raise HiddenStatesRejected(
            HiddenStatesProblem.NON_FINITE, f"non-finite values from token {bad}"
        )
    return hidden
