"""The eager reference tokenization: the processor decodes every image. Tests and the
benchmark check and measure the lazy path (`tokenization.ChatTokenizer`) against it; the
pipeline never uses it, so it lives beside the tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mm_assets.domain.prep.conversations import Turn
from mm_assets.domain.prep.supervision import GENERATION_MARKER

if TYPE_CHECKING:
    from PIL import Image
    from transformers import ProcessorMixin


def _decoded(path: str) -> Image.Image:
    """Pillow, not transformers' loader: its torchvision decoder needs compiled ops that
    the CPU build here lacks."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def tokenize_with_pixels(processor: ProcessorMixin, turns: Sequence[Turn]) -> dict[str, list]:
    """Ids (and, with `{% generation %}` markers, HF's assistant mask) from the processor
    run on the decoded images."""
    conv = [
        {
            **t,
            "content": [
                {"type": "image", "image": _decoded(p["path"])} if p["type"] == "image" else p
                for p in t["content"]
            ],
        }
        if isinstance(t["content"], list)
        else t
        for t in turns
    ]
    has_markers = bool(GENERATION_MARKER.search(processor.chat_template or ""))
    out = processor.apply_chat_template(
        conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=has_markers
    )
    ids = out["input_ids"]
    ids = ids[0] if ids and isinstance(ids[0], list) else ids
    result = {"input_ids": list(ids)}
    if out.get("image_grid_thw") is not None:
        result["image_grid_thw"] = [list(map(int, g)) for g in out["image_grid_thw"]]
    if has_markers:
        mask = out["assistant_masks"]
        result["loss_mask"] = list(mask[0] if mask and isinstance(mask[0], list) else mask)
    return result
