"""The target's token embeddings, final norm and lm_head, read from its safetensors.

Only these three tensors are loaded (never the whole model). The final norm is found as
the sibling of the language model's `embed_tokens` (`<prefix>norm.weight`), so a VLM's
vision-tower norms are never mistaken for it; a missing `lm_head` means tied embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open


@dataclass(frozen=True)
class TargetHead:
    embed_tokens: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]


def _weight_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {key: model_dir / name for key, name in mapping.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    keys: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), "pt") as fh:
            keys.update({key: file for key in fh.keys()})  # noqa: SIM118 - safe_open API
    return keys


def _read(files: dict[str, Path], key: str) -> torch.Tensor:
    with safe_open(str(files[key]), "pt") as fh:
        return fh.get_tensor(key).float()


def load_target_head(model_dir: Path) -> TargetHead:
    files = _weight_files(model_dir)
    embeds = [k for k in files if k.endswith("embed_tokens.weight")]
    embeds = sorted((k for k in embeds if "vision" not in k and "visual" not in k), key=len)
    if not embeds:
        raise KeyError(f"{model_dir}: no token embedding (…embed_tokens.weight) in the weights")
    prefix = embeds[0].removesuffix("embed_tokens.weight")
    norm_key = f"{prefix}norm.weight"
    if norm_key not in files:
        raise KeyError(f"{model_dir}: expected the final norm at {norm_key}")
    embed = _read(files, embeds[0])
    lm_head = _read(files, "lm_head.weight") if "lm_head.weight" in files else embed
    return TargetHead(embed, lm_head, _read(files, norm_key))
