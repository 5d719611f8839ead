"""The speculators checkpoint format of a DFlash draft (`speculators_model_type: dflash`),
which vLLM 0.32 serves with `method: dflash` (`checkpoint.py` has EAGLE-3's).

`transformer_layer_config` is a Qwen3 config of the draft's layers (defaults written
out: vLLM builds the draft from it) with plain 1D rope. `aux_hidden_state_layer_ids` are
the layers whose states the draft reads, numbered as EAGLE-3's are (vLLM turns them into
its `dflash_config.target_layer_ids` by subtracting one). `mask_token_id` is the token
fed in the masked slots; `block_size` is the anchor plus the draft tokens.
"""

from __future__ import annotations

from typing import Any

from mm_assets.domain.model.checkpoint import (
    FORMAT_VERSION,
    LAYER_FIELDS,
    layer_config,
    speculators_config,
)
from mm_assets.domain.model.dflash import DFlashConfig


def checkpoint_config(
    cfg: DFlashConfig,
    aux_layer_ids: list[int],
    verifier_path: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    verifier = (verifier_path, verifier_architectures)
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": layer_config(cfg, "qwen3", cfg.num_layers),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "mask_token_id": cfg.mask_token_id,
        "block_size": speculative_tokens + 1,
        "aux_hidden_state_layer_ids": list(aux_layer_ids),
        "speculators_config": speculators_config("dflash", verifier, speculative_tokens),
        "dtype": "float32",
        "mm_assets": provenance,
    }


def draft_shape(config: dict[str, Any]) -> DFlashConfig:
    """The draft a checkpoint's config describes."""
    layer = config["transformer_layer_config"]
    return DFlashConfig(
        **{key: layer[key] for key in LAYER_FIELDS},
        draft_vocab_size=config["draft_vocab_size"],
        mask_token_id=config["mask_token_id"],
        num_layers=layer["num_hidden_layers"],
        rope_theta=layer["rope_parameters"]["rope_theta"],
        num_aux=len(config["aux_hidden_state_layer_ids"]),
    )
