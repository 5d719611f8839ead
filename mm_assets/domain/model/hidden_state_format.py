"""How a sample's hidden states are stored: the speculators layout, or a compact one.

`native` is the speculators layout: `hidden_states` `[T, 4, H]` in the target's dtype
(3 auxiliary layers, then the last layer L), with `token_ids`. Two options shrink it:

- `dtype`: `bf16` (within 2^-8 of the row's maximum), or `fp8_e4m3` with one scale per
  (token, layer) mapping the row's absolute maximum to e4m3's 448, so every element is
  within half an fp8 step: 16/448 of the row's maximum, times (1 + 2^-8) for the scale's
  rounding to bf16 (`FP8_ERROR_BOUND`).
- `final_layer: needed`: layer L only where the loss reads it. Pre-shifted, the teacher
  of position i is layer L at original position i+1, counted when `loss_mask[i+1]` (a
  TTT step s: `loss_mask[i+1+s]`, the same set shifted), so exactly the original
  positions whose `loss_mask` is 1: `needed_positions`, which the encoder and the
  training loader both use. Image tokens and prompts, most of a multimodal row, then
  keep their three auxiliary layers only.

A compact blob holds `aux` `[T, 3, H]`, `final` `[M, H]`, `token_ids` (int32), and as
needed `aux_scale` `[T, 3]`, `final_scale` `[M]` and `final_runs` `[R, 2]` (the kept
positions as start/end runs); its metadata names the format, which the reader checks.
Encoding and decoding: `hidden_state_codec`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

FORMAT_TAG = "mm_assets.hidden_states.compact/1"
ERROR_KEY = "max_rel_error"
FP8_ERROR_BOUND = 16 / 448 * (1 + 2**-8)
BF16_ERROR_BOUND = 2**-8
NATIVE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# A blob's safetensors header plus the filesystem block it partly fills (an upper bound)
BLOB_OVERHEAD_BYTES = 4096


class StorageDtype(StrEnum):
    NATIVE = "native"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"


class FinalLayer(StrEnum):
    ALL = "all"
    NEEDED = "needed"


@dataclass(frozen=True)
class StorageFormat:
    dtype: StorageDtype = StorageDtype.NATIVE
    final_layer: FinalLayer = FinalLayer.ALL

    @property
    def is_native(self) -> bool:
        return self.dtype == StorageDtype.NATIVE and self.final_layer == FinalLayer.ALL

    @property
    def name(self) -> str:
        return f"{self.dtype.value}/{self.final_layer.value}"

    def element_bytes(self, native_dtype: str) -> int:
        if self.dtype == StorageDtype.NATIVE:
            return NATIVE_BYTES[native_dtype]
        return 2 if self.dtype == StorageDtype.BF16 else 1

    def estimate_bytes(
        self, tokens: int, supervised: int, hidden_size: int, native_dtype: str, blobs: int = 0
    ) -> int:
        """Bytes on disk for `blobs` rows of `tokens` tokens in all, `supervised` of them
        in the loss (the disk budget's estimate, and the bench's formula at any width)."""
        element = self.element_bytes(native_dtype)
        scale = 2 if self.dtype == StorageDtype.FP8_E4M3 else 0
        final_rows = supervised if self.final_layer == FinalLayer.NEEDED else tokens
        per_layer_row = hidden_size * element + scale
        ids = 8 if self.is_native else 4  # (the kept positions are a few runs per row)
        body = tokens * (3 * per_layer_row + ids) + final_rows * per_layer_row
        return body + blobs * BLOB_OVERHEAD_BYTES


def needed_positions(loss_mask: Sequence[int]) -> list[int]:
    """Original positions whose layer-L state the loss reads: where `loss_mask` is 1."""
    return [i for i, m in enumerate(loss_mask) if m]
