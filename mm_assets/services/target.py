"""The target model: where its files are, its processor, the facts the stages need
(layers, width, dtype, a content fingerprint), and the three tensors a draft takes from
its safetensors (`load_target_head`: token embeddings, final norm, lm_head; never the
whole model, and torch only then)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_assets.domain.ingest.images import processor_max_pixels
from mm_assets.domain.model.hidden_states import (
    TextConfigFacts,
    default_layer_ids,
    text_config_facts,
    validate_layer_ids,
)

if TYPE_CHECKING:
    import torch

_SAMPLE_CHUNK = 1 << 16
_SMALL_FILE = 64 << 20


@dataclass(frozen=True)
class TargetModel:
    """A local model directory or a hub id (resolved through the HF cache)."""

    path: str
    trust_remote_code: bool = False

    def load_processor(self) -> Any:
        """`AutoProcessor` for the target: a ProcessorMixin for VLMs, a tokenizer otherwise."""
        from transformers import AutoProcessor

        local = Path(self.path).expanduser()
        if self.path.startswith(("/", ".", "~")) and not local.exists():
            raise FileNotFoundError(
                f"target model {local} does not exist; build the demo with "
                "`python -m mm_assets.demo build` or set MM_ASSETS_TARGET_MODEL"
            )
        return AutoProcessor.from_pretrained(
            str(local) if local.exists() else self.path, trust_remote_code=self.trust_remote_code
        )

    def image_processor_max_pixels(self) -> int | None:
        """The pixel budget its image processor declares (`processor_max_pixels`). Only
        the processor's config is read (fetched alone for a hub id): no weights."""
        from transformers import AutoImageProcessor

        local = Path(self.path).expanduser()
        processor = AutoImageProcessor.from_pretrained(
            str(local) if local.exists() else self.path, trust_remote_code=self.trust_remote_code
        )
        return processor_max_pixels(processor)

    @cached_property
    def local_dir(self) -> Path:
        """The model's files on disk."""
        local = Path(self.path).expanduser()
        if local.is_dir():
            return local
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(self.path))

    @cached_property
    def config(self) -> dict[str, Any]:
        return json.loads((self.local_dir / "config.json").read_text())

    @property
    def facts(self) -> TextConfigFacts:
        return text_config_facts(self.config)

    @cached_property
    def fingerprint(self) -> str:
        return target_fingerprint(self.local_dir)

    def layer_ids(self, requested: list[int] | None = None) -> list[int]:
        """The requested hidden-state layer ids, checked; default [2, L//2, L-3, L]."""
        num_layers = self.facts.num_layers
        return validate_layer_ids(requested or default_layer_ids(num_layers), num_layers)


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
    from safetensors import safe_open

    keys: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), "pt") as fh:
            keys.update({key: file for key in fh.keys()})  # noqa: SIM118 - safe_open API
    return keys


def _read(files: dict[str, Path], key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(files[key]), "pt") as fh:
        return fh.get_tensor(key).float()


def load_target_head(model_dir: Path) -> TargetHead:
    """The final norm is the sibling of the language model's `embed_tokens`, so a VLM's
    vision-tower norms are never mistaken for it; no `lm_head` means tied embeddings."""
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
