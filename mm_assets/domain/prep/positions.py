"""Each token's position as the served target gives it to its draft.

vLLM hands a draft the positions of the target's own step: for a 1D-rope target
0..n-1 (stored as nothing), for an M-RoPE target (Qwen2-VL and its successors) the
first, temporal row of its 3D positions. In that row every placeholder token of an image
sits at the image's first position, and the text after the image resumes as many
positions later as the larger side of its merged patch grid (vLLM's
`get_mrope_input_positions`, transformers' `get_rope_index`). A draft trained on
0..n-1 sees, once served, image tokens and the text after them at distances it never
learned, so rows are stored with the positions the draft will be served with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def uses_mrope(config: Mapping) -> bool:
    """Whether a target's language model rotates by 3D (M-RoPE) positions: its rope
    parameters (`rope_parameters`, or the older `rope_scaling`) name an `mrope_section`,
    as vLLM decides it."""
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return "mrope_section" in rope


def image_advance(grid_thw: Sequence[int], merge_size: int) -> int:
    """Positions an image takes in the temporal row: the larger side of its grid of
    merged patches (an image has one temporal patch)."""
    _, height, width = (int(n) for n in grid_thw)
    return max(height, width) // merge_size


def placed_positions(
    ids: Sequence[int], image_token_id: int, counts: Sequence[int], advances: Sequence[int]
) -> list[int]:
    """The temporal row of an M-RoPE target's positions for expanded `ids`: image i's
    `counts[i]` placeholder tokens all at its first position, the next token
    `advances[i]` positions later; every other token one position after the last."""
    if len(counts) != len(advances):
        raise ValueError(f"{len(counts)} image token counts for {len(advances)} images")
    positions: list[int] = []
    images = iter(zip(counts, advances, strict=True))
    at, index = 0, 0
    while index < len(ids):
        if ids[index] != image_token_id:
            positions.append(at)
            at, index = at + 1, index + 1
            continue
        count, advance = next(images)
        if list(ids[index : index + count]) != [image_token_id] * count:
            raise ValueError(f"image at token {index} has fewer than its {count} tokens")
        positions += [at] * count
        at, index = at + advance, index + count
    return positions
