"""Settings of a speculator training run, declared once: the `trained_speculator`
asset's config and the `python -m mm_assets.train` arguments are generated from them.
Neither the device (it does not change what is learned) nor the layer ids (decided by
`hidden_states`, read from the stored states) is a setting.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    field_validator,
    model_validator,
)

from mm_assets.common.request_settings import MAX_CONCURRENCY

LOSSES = ("kl", "rkl", "jsd", "tv", "nla", "lk_hybrid", "ce")  # what each computes: losses.py


def parse_loss(recipe: str) -> dict[str, float]:
    """`kl` → {kl: 1}; `kl=0.5,tv=0.5` → both, weighted. Refuses unknown names and
    weights that are negative or all zero, saying which."""
    weights: dict[str, float] = {}
    for part in recipe.replace(" ", "").split(","):
        name, _, weight = part.partition("=")
        if name not in LOSSES:
            raise ValueError(f"loss {name!r} in {recipe!r}: use one of {', '.join(LOSSES)}")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"loss weight {weight!r} in {recipe!r} is not a number") from None
        if value < 0 or not math.isfinite(value) or name in weights:
            raise ValueError(f"loss {recipe!r}: each name once, with a finite weight ≥ 0")
        weights[name] = value
    if not any(weights.values()):
        raise ValueError(f"loss {recipe!r}: at least one weight must be above 0")
    return weights


# Bump when a change makes training produce something else from the same inputs: it is
# the `trained_speculator` code version and part of the reuse key, so both notice.
TRAINING_VERSION = "2"


class SpeculatorSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    epochs: int = Field(default=8, ge=1, description="Passes over the training rows.")
    learning_rate: FiniteFloat = Field(default=1e-3, gt=0, description="AdamW learning rate.")
    batch_tokens: int = Field(default=1024, ge=1, description="Tokens per packed batch.")
    ttt_steps: int = Field(
        default=3, ge=1, description="Test-time-training unroll: draft positions trained per root."
    )
    step_loss_decay: FiniteFloat = Field(
        default=1.0, gt=0, description="Weight of draft step k's loss is decay**k."
    )
    loss: str = Field(
        default="kl",
        description="kl | rkl | jsd | tv | nla | lk_hybrid | ce, or a weighted mix such as "
        "kl=0.5,tv=0.5 (what each computes: mm_assets/domain/model/losses.py).",
    )
    optimizer: Literal["adamw", "muon"] = Field(
        default="adamw",
        description="adamw; muon: torch's Muon on the layer's matrices, AdamW on the rest.",
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="How the learning rate moves after the warmup."
    )
    warmup_ratio: FiniteFloat = Field(
        default=0.0, ge=0, lt=1, description="Share of the steps the rate rises over from 0."
    )
    min_lr_ratio: FiniteFloat = Field(
        default=0.0,
        ge=0,
        le=1,
        description="linear / cosine: the last step's rate, as a share of learning_rate.",
    )
    noise_std: FiniteFloat = Field(
        default=0.0,
        ge=0,
        description="Gaussian noise on the target's auxiliary states while training, as a "
        "share of each state's RMS (0: none).",
    )
    norm_before_fc: bool = Field(
        default=False, description="An RMSNorm over the auxiliary states before fc."
    )
    fc_norm: bool = Field(
        default=False, description="An RMSNorm on each auxiliary state before fc (EAGLE-3.1)."
    )
    norm_output: bool = Field(
        default=False,
        description="Feed each draft step's normed output to the next (EAGLE-3.1), not the "
        "output before the final norm.",
    )
    init_from: str = Field(
        default="",
        description="Start from this EAGLE-3 draft (speculators format) instead of random "
        "weights: a local directory, the name of a draft trained here, or a hub id. Its "
        "vocabulary and norms are kept (draft_vocab_size and the norm settings do not "
        "apply); the optimizer is new.",
    )
    init_revision: str = Field(
        default="",
        description="The hub commit, tag or branch of init_from (a hub id only); empty: the "
        "newest, logged as unpinned, its commit recorded in the checkpoint.",
    )
    keep: Literal["last", "best_acceptance"] = Field(
        default="last",
        description="Which epoch's draft to keep: the last, or the one whose held-out "
        "acceptance estimate (replayed after every epoch) is highest.",
    )
    early_stop_patience: int = Field(
        default=0,
        ge=0,
        description="Stop after this many epochs without a higher held-out estimate (0: never).",
    )
    grad_clip: FiniteFloat = Field(default=1.0, gt=0, description="Gradient norm clipping.")
    seed: int = Field(default=0, description="Initialisation, batch order and held-out split.")
    split_seed: int | None = Field(
        default=None,
        description="The held-out split and row caps alone (None: `seed`): fixed, drafts "
        "trained under several seeds are measured on the same held-out prompts.",
    )
    draft_vocab_size: int = Field(
        default=32000, ge=1, description="Target tokens the draft can propose (most supervised)."
    )
    held_out_fraction: FiniteFloat = Field(
        default=0.1, ge=0, lt=1, description="Share of rows kept out of training for evaluation."
    )
    speculative_tokens: int = Field(
        default=3, ge=1, description="Draft tokens per step when vLLM serves the checkpoint."
    )
    draft: Literal["eagle3", "dflash", "peagle"] = Field(
        default="eagle3",
        description="The draft family: eagle3 (one layer, one token per pass, unrolled "
        "ttt_steps deep in training), peagle (the same layer drafting every token in one "
        "pass: the slots after the first read mask_token_id and a learned state) or dflash "
        "(a block of speculative_tokens proposed in one pass; trained on blocks of "
        "ttt_steps).",
    )
    dflash_layers: int = Field(default=2, ge=1, le=16, description="DFlash: decoder layers.")
    mask_token_id: int | None = Field(
        default=None,
        ge=0,
        description="DFlash and P-EAGLE: the token fed in masked slots; its embedding is the "
        "target's. None: the last id of the target's vocabulary (a padding row in most).",
    )

    @property
    def held_out_seed(self) -> int:
        """What chooses the held-out rows and the capped ones."""
        return self.seed if self.split_seed is None else self.split_seed

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        parse_loss(value)
        return value

    @model_validator(mode="after")
    def _one_norm_before_fc(self) -> SpeculatorSettings:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError(
                "norm_before_fc and fc_norm both norm fc's input (one norm over the "
                "states, or one per state): set one of them, as speculators requires"
            )
        return self


class TrackingSettings(BaseModel):
    """Where a training's curves go besides the step's metadata (`services/tracking.py`).
    Not part of what is learned, so not in `SpeculatorSettings`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tracking: Literal["none", "tensorboard", "mlflow"] = Field(
        default="none",
        description="Log per-step loss and learning rate, per-epoch held-out loss and "
        "acceptance estimate, and the settings to TensorBoard or MLflow (the tracking extra).",
    )
    tracking_uri: str = Field(
        default="",
        description="tensorboard: the log directory; mlflow: the tracking URI (http://…, "
        "sqlite:///…); empty: for mlflow $MLFLOW_TRACKING_URI when set (read when the step "
        "runs), else under the storage root, tracking/.",
    )


class MeasurementSettings(BaseModel):
    """How `trained_speculator` measures the draft in vLLM after training."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    measure_in_vllm: bool = Field(
        default=True, description="Serve the target with the draft; read vLLM's counters."
    )
    vllm_prompts: int = Field(default=32, ge=1, description="Held-out prompts vLLM generates from.")
    vllm_max_tokens: int = Field(default=64, ge=1, description="Tokens generated per prompt.")
    vllm_concurrency: int = Field(
        default=1,
        ge=1,
        le=MAX_CONCURRENCY,
        description="Held-out requests in flight. 1: the latency regime, and figures that do "
        "not move with how vLLM batched the requests (each reply has its own counts at any "
        "concurrency; batching moves greedy tokens where logits are close).",
    )
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
        le=64,
        description="Online only. Batches whose states are requested ahead of the one training; "
        "at most 64: each holds its states on disk until it trains.",
    )


MAX_DEPTH = 16


class BenchmarkSettings(BaseModel):
    """How a benchmark is run, declared once (the asset's config is made from it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(default=128, ge=1, description="Tokens generated per request.")
    concurrency: int = Field(
        default=1,
        ge=1,
        le=MAX_CONCURRENCY,
        description="Requests in flight. 1: the latency regime speculative decoding is for; "
        "at most 1024, as for the other stages' requests.",
    )
    speculative_tokens: list[Annotated[int, Field(ge=1, le=MAX_DEPTH)]] | None = Field(
        default=None,
        min_length=1,
        description="Depths (tokens proposed per step) the draft and n-gram are measured at, "
        "one server each, e.g. [1, 3, 5]: where speculation pays on this hardware. None: "
        "the draft's own (n-gram: the draft's, or 3).",
    )
    prompt_lookup_min: int = Field(default=2, ge=1, description="n-gram: shortest match.")
    prompt_lookup_max: int = Field(default=4, ge=1, description="n-gram: longest match.")
    max_prompts_per_category: int | None = Field(
        default=None, ge=1, description="Conversations measured per category; None: all."
    )
    warmup_max_tokens: int = Field(
        default=8, ge=1, description="Tokens of the warm-up request sent to each server."
    )
    start_servers_together: bool | None = Field(
        default=None,
        description="Start the methods' servers at once (their start-ups overlap), then "
        "measure each in turn while the others idle; else one at a time. None: together "
        "on CPU, one at a time on a GPU (each server would claim most of its memory).",
    )
