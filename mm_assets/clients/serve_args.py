"""The arguments that make a vLLM server what a step needs: one that writes the hidden
states of chosen layers to files (extraction), or one that serves a trained draft."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mm_assets.clients.vllm_server import cuda_available

CPU_CONNECTOR = ("CpuHiddenStatesConnector", "mm_assets.clients.cpu_hidden_states_connector")
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# Each reply carries its own drafts and accepted tokens, so a benchmark's figures are
# per prompt (`vllm_generation.reply_metrics`); vLLM refuses it without speculation.
PER_REQUEST_ACCEPTANCE = ["--per-request-spec-decode-metrics", "summary"]


def extraction_args(layer_ids: Sequence[int], hidden_states_dir: Path, connector: str) -> list[str]:
    """Server arguments that make every request write its hidden states to a file;
    `connector="auto"` takes the CPU-safe connector where there is no CUDA device."""
    use_cpu = connector == "cpu" or (connector == "auto" and not cuda_available())
    speculative, transfer = extraction_configs(layer_ids, hidden_states_dir, use_cpu)
    hidden_states_dir.mkdir(parents=True, exist_ok=True)
    # --enable-scale-out: the token-in route rows with images are sent through
    configs = ["--speculative-config", speculative, "--kv-transfer-config", transfer]
    return [*configs, "--enable-scale-out"]


DRAFT_METHODS: dict[str, dict[str, Any]] = {
    "eagle3": {"method": "eagle3"},
    "dflash": {"method": "dflash"},
    "peagle": {"method": "eagle3", "parallel_drafting": True},
}
"""How vLLM serves each draft family's checkpoint (by its `speculators_model_type`)."""


def speculative_decoding_args(
    draft_dir: Path, num_speculative_tokens: int, method: str = "eagle3"
) -> list[str]:
    """Server arguments that serve the target with a trained draft (`method`: its
    family, one of `DRAFT_METHODS`)."""
    if method not in DRAFT_METHODS:
        raise ValueError(f"draft method {method!r} is not one of {', '.join(DRAFT_METHODS)}")
    config = {
        "model": str(draft_dir),
        **DRAFT_METHODS[method],
        "num_speculative_tokens": num_speculative_tokens,
    }
    return ["--speculative-config", json.dumps(config), *PER_REQUEST_ACCEPTANCE]


def ngram_args(speculative_tokens: int, lookup_min: int, lookup_max: int) -> list[str]:
    """Server arguments that serve the target with vLLM's n-gram prompt lookup."""
    config = {
        "method": "ngram",
        "num_speculative_tokens": speculative_tokens,
        "prompt_lookup_max": lookup_max,
        "prompt_lookup_min": lookup_min,
    }
    return ["--speculative-config", json.dumps(config), *PER_REQUEST_ACCEPTANCE]


def extraction_configs(
    layer_ids: Sequence[int], hidden_states_dir: Path, use_cpu_connector: bool
) -> tuple[str, str]:
    """The `--speculative-config` and `--kv-transfer-config` JSON for hidden-state export."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }
    transfer: dict = {
        "kv_connector": STOCK_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(hidden_states_dir)},
    }
    if use_cpu_connector:
        transfer["kv_connector"], transfer["kv_connector_module_path"] = CPU_CONNECTOR
    return json.dumps(speculative), json.dumps(transfer)
