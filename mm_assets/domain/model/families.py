"""Draft families: the one place the services learn which kind of draft they train.

A family is named once (`SpeculatorSettings.draft`), and that name is everything else's
too: the checkpoint's `speculators_model_type`, the `method` vLLM serves it with, the
`method` column of the benchmark tables. It brings its model (`draft_parts.DraftModel`),
the config a training builds for a target, its checkpoint format and the config key its
auxiliary layer ids are written under. Everything else (hidden states, the draft
vocabulary, the training loop, warm start, measurement, benchmark, tables) is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from mm_assets.domain.model import checkpoint, dflash_checkpoint
from mm_assets.domain.model.dflash import DFlashConfig, DFlashDraft, dflash_config
from mm_assets.domain.model.draft_parts import DraftModel
from mm_assets.domain.model.eagle3 import Eagle3Config, Eagle3Draft, draft_config
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.domain.prep.positions import uses_mrope

DraftConfig = Eagle3Config | DFlashConfig


@dataclass(frozen=True)
class DraftFamily:
    name: str
    new_config: Callable[[dict[str, Any], SpeculatorSettings], DraftConfig]
    """The draft a training builds for this target (its config.json) and settings."""
    model: Callable[[Any], DraftModel]
    checkpoint_config: Callable[..., dict[str, Any]]
    """(config, aux layer ids, verifier path, its architectures, speculative tokens,
    provenance) -> the checkpoint's config.json."""
    shape: Callable[[dict[str, Any]], DraftConfig]
    """The draft a checkpoint's config.json describes."""
    aux_key: str
    """Where the checkpoint's config names the target layers the draft reads."""
    serving_caveats: Callable[[dict[str, Any]], list[str]] = lambda target_config: []
    """What the pinned vLLM gets wrong serving this family for this target (logged at
    training and in its metadata)."""


MROPE_SLOTS = (
    "vLLM 0.32's model runner writes a parallel draft's keys and values (DFlash's context, "
    "P-EAGLE's one pass) into its KV cache at the target's M-RoPE positions instead of its "
    "token indices: the tokens of an image, which share one position, overwrite each "
    "other, and the served draft reads a context it was never trained on. Its acceptance "
    "on image prompts stays well below the held-out estimate; text prompts are unaffected "
    "(BENCHMARKS.md, 'Draft families'). Until vLLM slots them by token index (vllm-ascend "
    "did, #9340), serve EAGLE-3 for image prompts of an M-RoPE target."
)


def _parallel_caveats(target_config: dict[str, Any]) -> list[str]:
    return [MROPE_SLOTS] if uses_mrope(target_config) else []


def _mask_token(target_config: dict[str, Any], settings: SpeculatorSettings) -> int:
    """The token masked slots read: the setting, or the target vocabulary's last id."""
    text = target_config.get("text_config") or target_config
    mask = settings.mask_token_id
    mask = int(text["vocab_size"]) - 1 if mask is None else mask
    if not 0 <= mask < int(text["vocab_size"]):
        raise ValueError(
            f"mask_token_id {mask} is not a token of the target (vocabulary of "
            f"{text['vocab_size']}); leave it empty for the vocabulary's last id"
        )
    return mask


def _dflash(target_config: dict[str, Any], settings: SpeculatorSettings) -> DFlashConfig:
    mask = _mask_token(target_config, settings)
    return dflash_config(target_config, settings.draft_vocab_size, mask, settings.dflash_layers)


def _peagle(target_config: dict[str, Any], settings: SpeculatorSettings) -> Eagle3Config:
    mask = _mask_token(target_config, settings)
    return replace(draft_config(target_config, settings), mask_token_id=mask)


FAMILIES = {
    "eagle3": DraftFamily(
        "eagle3",
        draft_config,
        Eagle3Draft,
        checkpoint.checkpoint_config,
        checkpoint.draft_shape,
        "eagle_aux_hidden_state_layer_ids",
    ),
    "dflash": DraftFamily(
        "dflash",
        _dflash,
        DFlashDraft,
        dflash_checkpoint.checkpoint_config,
        dflash_checkpoint.draft_shape,
        "aux_hidden_state_layer_ids",
        _parallel_caveats,
    ),
    "peagle": DraftFamily(
        "peagle",
        _peagle,
        Eagle3Draft,
        checkpoint.checkpoint_config,
        checkpoint.draft_shape,
        "eagle_aux_hidden_state_layer_ids",
        _parallel_caveats,
    ),
}


def family_of(config: dict[str, Any], where: str = "the checkpoint") -> DraftFamily:
    """The family a checkpoint's config.json says it is; refused when it is none here."""
    name = config.get("speculators_model_type")
    if name not in FAMILIES:
        raise ValueError(
            f"{where}: speculators_model_type {name!r} is not a draft family trained here "
            f"({', '.join(FAMILIES)})"
        )
    return FAMILIES[name]


def fit_problems(
    config: dict[str, Any], family: DraftFamily, target: DraftConfig, layer_ids: list[int]
) -> list[str]:
    """Why a checkpoint cannot start a draft of this family for this target (empty: it
    can): its family, hidden size, vocabulary and auxiliary layer ids must be the ones
    trained here and the states'."""
    layer = config.get("transformer_layer_config") or {}
    problems = []
    if config.get("speculators_model_type") != family.name:
        problems.append(
            f"speculators_model_type {config.get('speculators_model_type')!r} ≠ "
            f"{family.name!r} (the draft setting)"
        )
    if layer.get("hidden_size") != target.hidden_size:
        problems.append(
            f"hidden size {layer.get('hidden_size')} ≠ the target's {target.hidden_size}"
        )
    if layer.get("vocab_size") != target.vocab_size:
        problems.append(f"vocabulary {layer.get('vocab_size')} ≠ the target's {target.vocab_size}")
    aux = config.get(family.aux_key)
    if aux is not None and list(aux) != list(layer_ids[: len(aux)]):
        problems.append(
            f"auxiliary layer ids {list(aux)} ≠ {list(layer_ids[: len(aux)])}, those the "
            "hidden states are extracted with (hidden_states' layer_ids)"
        )
    return problems


def draft_from(config: dict[str, Any], state: dict[str, torch.Tensor], where: str) -> DraftModel:
    """Our model from a checkpoint's config and tensors (verifier parts are not in it: the
    teacher needs `init_from_target` or `attach_target` before computing losses)."""
    family = family_of(config, where)
    model = family.model(family.shape(config))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {k for k in missing if k.startswith(checkpoint.NOT_SAVED) or k in ("d2t", "t2d")}
    if set(missing) - allowed or unexpected:
        raise ValueError(
            f"{where}: missing {sorted(set(missing) - allowed)}, unexpected {unexpected}"
        )
    return model
