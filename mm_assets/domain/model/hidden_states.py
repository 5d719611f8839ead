"""Hidden states for EAGLE-3 training: layer ids, the stored layout, cache keys, sizes.

Layer id convention (recorded in every artifact, checked by training): id k is the
residual stream after k decoder layers (HF `hidden_states[k]`); id L (the last layer) is
that layer's output *before* the final norm (HF's `hidden_states[-1]` is after it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, FiniteFloat

from mm_assets.common.hashing import json_sha256
from mm_assets.common.request_settings import RequestSettings
from mm_assets.domain.model.hidden_state_format import (
    NATIVE_BYTES,
    FinalLayer,
    StorageDtype,
    StorageFormat,
    needed_positions,
)

LAYER_CONVENTION = "residual_after_k_layers;L=pre_final_norm"


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's usual choice: low, middle and high auxiliary layers, plus the last; three
    distinct ones spread the same way where a small target makes the usual ones repeat."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 needs a target with at least 4 layers, got {num_layers}")
    usual = [2, num_layers // 2, num_layers - 3]
    aux = usual if len(set(usual)) == 3 else [1, num_layers // 2, num_layers - 1]
    return [*aux, num_layers]


def validate_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in layer_ids]
    ok = len(ids) == 4 and ids[-1] == num_layers and all(0 < i <= num_layers for i in ids)
    if not ok or len(set(ids[:3])) != 3:
        raise ValueError(
            f"layer_ids {ids}: give three distinct auxiliary layers in 1..{num_layers} (vLLM "
            "reads a repeated layer once, leaving the draft's input short) followed by the "
            f"last layer {num_layers} (default {default_layer_ids(num_layers)})"
        )
    return ids


@dataclass(frozen=True)
class TextConfigFacts:
    num_layers: int
    hidden_size: int
    dtype: str
    image_token_id: int | None = None
    """The placeholder token each image expands to a run of (vision-language targets)."""


def text_config_facts(config: Mapping) -> TextConfigFacts:
    """Layers, width and dtype of the language model (`text_config` for VLMs), and the
    image placeholder id (`image_token_id`, or LLaVA's `image_token_index`)."""
    text = config.get("text_config") or config
    dtype = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "float32"
    image = config.get("image_token_id", config.get("image_token_index"))
    return TextConfigFacts(
        int(text["num_hidden_layers"]),
        int(text["hidden_size"]),
        str(dtype),
        None if image is None else int(image),
    )


def cache_key(
    target: str,
    layer_ids: Sequence[int],
    dtype: str,
    input_ids: Sequence[int],
    image_hashes: Sequence[str],
) -> str:
    """Content address of one sample's hidden states: anything that changes them is in it."""
    return json_sha256(
        [target, list(layer_ids), LAYER_CONVENTION, dtype, list(input_ids), list(image_hashes)]
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def resolve_dtype(requested: str, facts: TextConfigFacts) -> str:
    """`auto` means the target config's dtype; only dtypes the store knows are allowed."""
    dtype = facts.dtype if requested == "auto" else requested
    if dtype not in NATIVE_BYTES:
        raise ValueError(f"dtype {dtype!r} unsupported for hidden states; use {list(NATIVE_BYTES)}")
    return dtype


@dataclass(frozen=True)
class HiddenStatesLayout:
    """What one stored sample holds: `[T, len(layer_ids), hidden_size]` received in
    `dtype` from this target, stored in `storage`'s format."""

    target_fingerprint: str
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    storage: StorageFormat = field(default_factory=StorageFormat)

    def key(
        self, input_ids: Sequence[int], image_hashes: Sequence[str], loss_mask: Sequence[int]
    ) -> str:
        """The native format keeps the keys it always had (switching back to it reuses
        its blobs); another format adds its name, and `needed` the positions it keeps."""
        key = cache_key(
            self.target_fingerprint, self.layer_ids, self.dtype, input_ids, image_hashes
        )
        if self.storage.is_native:
            return key
        kept = (
            needed_positions(loss_mask) if self.storage.final_layer == FinalLayer.NEEDED else None
        )
        return json_sha256([key, self.storage.name, kept])

    def estimate(self, tokens: int, supervised: int, blobs: int) -> int:
        """Bytes `blobs` new rows will take on disk in this layout's format."""
        return self.storage.estimate_bytes(tokens, supervised, self.hidden_size, self.dtype, blobs)


class ExtractionSettings(RequestSettings):
    """Knobs of a hidden-states run (the `hidden_states` asset's config)."""

    layer_ids: list[int] | None = Field(
        default=None,
        min_length=4,
        max_length=4,
        description="Three auxiliary layers and the last (default [2, L//2, L-3, L]), checked "
        "against the target before any request; training reads them from the stored states.",
    )
    max_rejection_ratio: FiniteFloat = Field(
        default=0.01, ge=0, le=1, description="The blocking check fails above this share."
    )
    storage_dtype: Literal["native", "bf16", "fp8_e4m3"] = Field(
        default="native",
        description="native (the target's dtype, speculators' layout), bf16, or fp8_e4m3 "
        "with one scale per token and layer.",
    )
    final_layer: Literal["all", "needed"] = Field(
        default="all",
        description="all, or needed: the last layer only where the loss reads it.",
    )

    @property
    def storage(self) -> StorageFormat:
        return StorageFormat(StorageDtype(self.storage_dtype), FinalLayer(self.final_layer))
