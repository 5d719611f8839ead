"""Hidden states for EAGLE-3 training: layer ids, cache keys, size estimates, validation.

Layer id convention (recorded in every artifact): id k is the residual stream after k
decoder layers (HF `hidden_states[k]`); id L (the last layer) is that layer's output
*before* the final norm (HF's `hidden_states[-1]` is after it). Training uses the first
three ids as auxiliary inputs and id L for the teacher logits (final norm + lm_head). A
mismatch between generation and training silently collapses acceptance, so it is checked.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from mm_assets.domain.rejection import RowRejected

LAYER_CONVENTION = "residual_after_k_layers;L=pre_final_norm"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAMPLE_CHUNK = 1 << 16
_SMALL_FILE = 64 << 20


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's usual choice: low, middle and high auxiliary layers, plus the last."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 needs a target with at least 4 layers, got {num_layers}")
    return [2, num_layers // 2, num_layers - 3, num_layers]


def validate_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in layer_ids]
    if len(ids) != 4 or ids[-1] != num_layers or not all(0 < i <= num_layers for i in ids):
        raise ValueError(
            f"layer_ids {ids}: give three auxiliary layers in 1..{num_layers} followed by "
            f"the last layer {num_layers} (default {default_layer_ids(num_layers)})"
        )
    return ids


@dataclass(frozen=True)
class TextConfigFacts:
    num_layers: int
    hidden_size: int
    dtype: str


def text_config_facts(config: Mapping) -> TextConfigFacts:
    """Layers, width and dtype of the language model (`text_config` for VLMs)."""
    text = config.get("text_config") or config
    dtype = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "float32"
    return TextConfigFacts(int(text["num_hidden_layers"]), int(text["hidden_size"]), str(dtype))


def target_fingerprint(model_dir: Path) -> str:
    """A content fingerprint of a model directory, cheap even for large weights: small
    files are hashed whole, large ones by size plus evenly spaced samples (a fine-tune
    changes essentially every byte, so the samples change too)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(model_dir)}:{size}\n".encode())
        with open(file, "rb") as fh:
            if size <= _SMALL_FILE:
                digest.update(fh.read())
                continue
            for i in range(16):
                fh.seek((size - _SAMPLE_CHUNK) * i // 15)
                digest.update(fh.read(_SAMPLE_CHUNK))
    return digest.hexdigest()[:24]


def cache_key(
    target: str,
    layer_ids: Sequence[int],
    dtype: str,
    input_ids: Sequence[int],
    image_hashes: Sequence[str],
) -> str:
    """Content address of one sample's hidden states: anything that changes them is in it."""
    payload = json.dumps(
        [target, list(layer_ids), LAYER_CONVENTION, dtype, list(input_ids), list(image_hashes)],
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def estimate_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype: str) -> int:
    """Bytes on disk for `num_tokens` tokens (+ int64 token ids and a small header)."""
    per_token = num_layers * hidden_size * DTYPE_BYTES[dtype] + 8
    return num_tokens * per_token + 4096


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


class HiddenStatesProblem(StrEnum):
    TOKEN_MISMATCH = "token_mismatch"
    BAD_FILE = "bad_file"
    BAD_SHAPE = "bad_shape"
    BAD_DTYPE = "bad_dtype"
    NON_FINITE = "non_finite"


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
    if hidden.dtype != TORCH_DTYPES[dtype]:
        raise HiddenStatesRejected(
            HiddenStatesProblem.BAD_DTYPE, f"{hidden.dtype}, expected {dtype}"
        )
    hidden = hidden[:n]
    if not torch.isfinite(hidden).all():
        bad = int((~torch.isfinite(hidden)).any(dim=(1, 2)).nonzero()[0])
        raise HiddenStatesRejected(
            HiddenStatesProblem.NON_FINITE, f"non-finite values from token {bad}"
        )
    return hidden


def eta_seconds(done: int, total: int, elapsed: float) -> float:
    if done == 0:
        return math.inf
    return elapsed / done * (total - done)
