"""The speculators checkpoint format (what vLLM and `speculators` load).

`config.json` carries `speculators_model_type: "eagle3"`, the full one-layer Llama config
the draft is built from (`transformer_layer_config`, defaults written out because vLLM uses
it as the draft's HF config), the four norm flags written explicitly (vLLM and
speculators default them differently), the auxiliary layer ids and the verifier.
`model.safetensors` holds the draft's weights only: `d2t`/`t2d` (omitted when the draft
vocabulary is the whole target vocabulary), `embed_tokens`, `fc`, `layers.0.*`, `norm`,
`lm_head`; never the verifier's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mm_assets.common.files import atomic_directory
from mm_assets.domain.model.eagle3 import Eagle3Config, Eagle3Draft

FORMAT_VERSION = "0.9.0"  # the speculators release whose format this follows
_NOT_SAVED = ("verifier_norm.", "verifier_lm_head.")


def layer_config(cfg: Eagle3Config) -> dict[str, Any]:
    from transformers import LlamaConfig  # here: importing transformers takes seconds

    llama = LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=False,
    )
    return llama.to_dict()


def checkpoint_config(
    cfg: Eagle3Config,
    aux_layer_ids: list[int],
    verifier_path: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": cfg.norm_output,
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
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


def draft_state(model: Eagle3Draft) -> dict[str, torch.Tensor]:
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith(_NOT_SAVED)
    }
    if model.cfg.draft_vocab_size == model.cfg.vocab_size:
        state.pop("d2t"), state.pop("t2d")
    return state


def save_checkpoint(model: Eagle3Draft, config: dict[str, Any], out_dir: Path) -> Path:
    """Write config.json + model.safetensors into `out_dir`, replacing it atomically."""
    with atomic_directory(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file(draft_state(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def load_checkpoint(path: Path) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Our model from a checkpoint directory (verifier parts are not in it: the teacher
    needs `init_from_target` before computing losses)."""
    config = json.loads((path / "config.json").read_text())
    layer = config["transformer_layer_config"]
    cfg = Eagle3Config(
        hidden_size=layer["hidden_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer["head_dim"],
        intermediate_size=layer["intermediate_size"],
        vocab_size=layer["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        rms_norm_eps=layer["rms_norm_eps"],
        rope_theta=layer["rope_parameters"]["rope_theta"],
        max_position_embeddings=layer["max_position_embeddings"],
        num_aux=len(config["eagle_aux_hidden_state_layer_ids"]),
        norm_before_residual=config["norm_before_residual"],
        norm_output=config["norm_output"],
    )
    model = Eagle3Draft(cfg)
    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {k for k in missing if k.startswith(_NOT_SAVED) or k in ("d2t", "t2d")}
    if set(missing) - allowed or unexpected:
        raise ValueError(
            f"{path}: missing {sorted(set(missing) - allowed)}, unexpected {unexpected}"
        )
    return model, config
