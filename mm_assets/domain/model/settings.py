"""Settings of a speculator training run, declared once.

The `trained_speculator` asset's config and the `python -m mm_assets.train` (torchrun)
arguments are both generated from these fields, so a knob has one name, one default and
one description wherever a user sets it. The device is not a setting: it is where the
run happens (auto: CUDA when present), and it does not change what is learned. Nor are
the layer ids: they are decided once, by `hidden_states` (`ExtractionSettings.layer_ids`),
and training reads them from the states it trains on.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Bump when a change makes training produce something else from the same inputs: it is
# the `trained_speculator` code version and part of the reuse key, so both notice.
TRAINING_VERSION = "2"


class SpeculatorSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    epochs: int = Field(default=8, ge=1, description="Passes over the training rows.")
    learning_rate: float = Field(default=1e-3, gt=0, description="AdamW learning rate.")
    batch_tokens: int = Field(default=1024, ge=1, description="Tokens per packed batch.")
    ttt_steps: int = Field(
        default=3, ge=1, description="Test-time-training unroll: draft positions trained per root."
    )
    step_loss_decay: float = Field(
        default=1.0, gt=0, description="Weight of draft step k's loss is decay**k."
    )
    grad_clip: float = Field(default=1.0, gt=0, description="Gradient norm clipping.")
    seed: int = Field(default=0, description="Initialisation, batch order and held-out split.")
    draft_vocab_size: int = Field(
        default=32000, ge=1, description="Target tokens the draft can propose (most supervised)."
    )
    held_out_fraction: float = Field(
        default=0.1, ge=0, lt=1, description="Share of rows kept out of training for evaluation."
    )
    speculative_tokens: int = Field(
        default=3, ge=1, description="Draft tokens per step when vLLM serves the checkpoint."
    )


class MeasurementSettings(BaseModel):
    """How `trained_speculator` measures the draft in vLLM after training."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    measure_in_vllm: bool = Field(
        default=True, description="Serve the target with the draft; read vLLM's counters."
    )
    vllm_prompts: int = Field(default=32, ge=1, description="Held-out prompts vLLM generates from.")
    vllm_max_tokens: int = Field(default=64, ge=1, description="Tokens generated per prompt.")
    compare_with_sources: bool = Field(
        default=True,
        description="Drafts of several datasets: also serve each source's own draft (its "
        "trained_speculator checkpoint, when there is one) on the same prompts.",
    )
    measure_untrained_in_vllm: bool = Field(
        default=True,
        description="Also serve the untrained draft on the same prompts (one more server "
        "start): the baseline the trained draft's acceptance is read against.",
    )


class OnlineSettings(BaseModel):
    """Where training reads the target's hidden states from. Not part of what is learned
    (an online run trains on the same batches as an offline one), so not in
    `SpeculatorSettings`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_states: Literal["stored", "online"] = Field(
        default="stored",
        description="stored: train on what `hidden_states` stored; online: `hidden_states` "
        "stores nothing and training fetches each batch's states from vLLM as it trains.",
    )
    online_cache: Literal["keep", "discard"] = Field(
        default="keep",
        description="Online only. keep: fetched states stay in the blob store (later epochs "
        "and runs request nothing again); discard: each batch's files are deleted once it "
        "is built, so disk holds at most prefetch_batches + 1 batches and every epoch "
        "requests its rows again.",
    )
    prefetch_batches: int = Field(
        default=2,
        ge=0,
        description="Online only. Batches whose states are requested ahead of the one training.",
    )
