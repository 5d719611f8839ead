"""The speculators checkpoint format (what vLLM and `speculators` load; the files are
written and read by `storage/checkpoints.py`).

`config.json` (EAGLE-3's, or P-EAGLE's with its `mask_token_id`) carries the full
one-layer Llama config (`transformer_layer_config`, defaults written out: vLLM uses it as
the draft's HF config) and the four norm flags written explicitly (vLLM and speculators
default them differently). The weights are the draft's only, never the verifier's;
`d2t`/`t2d` are omitted when the draft vocabulary is the whole target vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from mm_assets.domain.model.draft_parts import DraftModel
from mm_assets.domain.model.eagle3 import Eagle3Config

FORMAT_VERSION = "0.9.0"  # the speculators release whose format this follows
NOT_SAVED = ("verifier_norm.", "verifier_lm_head.")
# what a draft's layer config carries of its family's config (written, and read back)
# fmt: off
LAYER_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings")
# fmt: on


def layer_config(cfg: Any, model_type: str, layers: int) -> dict[str, Any]:
    """The draft's `transformer_layer_config`: a full transformers config of `model_type`
    (defaults written out: vLLM builds the draft from it) with plain 1D rope."""
    from transformers import AutoConfig  # here: importing transformers takes seconds

    config = AutoConfig.for_model(
        model_type,
        **{key: getattr(cfg, key) for key in LAYER_FIELDS},
        num_hidden_layers=layers,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=False,
    )
    return config.to_dict()


def speculators_config(
    algorithm: str, verifier: tuple[str, list[str]], speculative_tokens: int
) -> dict[str, Any]:
    """The `speculators_config` block: greedy proposals of `speculative_tokens`, checked
    against the verifier (its path and architectures)."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier[0], "architectures": verifier[1]},
    }


def checkpoint_config(
    cfg: Eagle3Config,
    aux_layer_ids: list[int],
    verifier_path: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    verifier = (verifier_path, verifier_architectures)
    kind = "eagle3" if cfg.mask_token_id is None else "peagle"  # P-EAGLE: parallel slots
    parallel = {} if cfg.mask_token_id is None else {"mask_token_id": cfg.mask_token_id}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": kind,
        **parallel,
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": layer_config(cfg, "llama", 1),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "speculators_config": speculators_config(kind, verifier, speculative_tokens),
        "dtype": "float32",
        "mm_assets": provenance,
    }


def speculative_tokens(config: dict[str, Any]) -> int:
    """The tokens a checkpoint's draft proposes a step (its default proposal method)."""
    spec = config["speculators_config"]
    methods = {m["proposal_type"]: m for m in spec["proposal_methods"]}
    return int(methods[spec["default_proposal_method"]]["speculative_tokens"])


def draft_state(model: DraftModel) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds, of any family: the teacher is the verifier's."""
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith(NOT_SAVED)
    }
    if model.cfg.draft_vocab_size == model.cfg.vocab_size:
        state.pop("d2t"), state.pop("t2d")
    return state


def draft_shape(config: dict[str, Any]) -> Eagle3Config:
    """The draft a checkpoint's config describes (its layer, vocabulary and norms)."""
    layer = config["transformer_layer_config"]
    return Eagle3Config(
        **{key: layer[key] for key in LAYER_FIELDS},
        draft_vocab_size=config["draft_vocab_size"],
        rope_theta=layer["rope_parameters"]["rope_theta"],
        num_aux=len(config["eagle_aux_hidden_state_layer_ids"]),
        norm_before_residual=config["norm_before_residual"],
        norm_output=config["norm_output"],
        norm_before_fc=bool(config.get("norm_before_fc")),
        fc_norm=bool(config.get("fc_norm")),
        mask_token_id=config.get("mask_token_id"),
    )
