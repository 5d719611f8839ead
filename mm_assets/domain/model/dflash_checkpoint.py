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

from mm_assets.domain.model.checkpoint import FORMAT_VERSION
from mm_assets.domain.model.dflash import DFlashConfig

# what the draft's layer config carries of `DFlashConfig` (written, and read back)
# fmt: off
_LAYER_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings")
# fmt: on


def layer_config(cfg: DFlashConfig) -> dict[str, Any]:
    from transformers import Qwen3Config  # here: importing transformers takes seconds

    qwen3 = Qwen3Config(
        **{key: getattr(cfg, key) for key in _LAYER_FIELDS},
        num_hidden_layers=cfg.num_layers,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=False,
    )
    return qwen3.to_dict()


def checkpoint_config(
    cfg: DFlashConfig,
    aux_layer_ids: list[int],
    verifier_path: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "mask_token_id": cfg.mask_token_id,
        "block_size": speculative_tokens + 1,
        "aux_hidden_state_layer_ids": list(aux_layer_ids),
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_path, "architectures": verifier_architectures},
        },
        "dtype": "float32",
        "mm_assets": provenance,
    }


def draft_shape(config: dict[str, Any]) -> DFlashConfig:
    """The draft a checkpoint's config describes."""
    layer = config["transformer_layer_config"]
    return DFlashConfig(
        **{key: layer[key] for key in _LAYER_FIELDS},
        draft_vocab_size=config["draft_vocab_size"],
        mask_token_id=config["mask_token_id"],
        num_layers=layer["num_hidden_layers"],
        rope_theta=layer["rope_parameters"]["rope_theta"],
        num_aux=len(config["aux_hidden_state_layer_ids"]),
    )
