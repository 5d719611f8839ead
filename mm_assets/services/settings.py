"""A stage's settings for a dataset or a draft, resolved one way for every caller (the
assets, `python -m mm_assets.train`): the model's defaults < the registry entry's < the
keys launched with. The registry is read here against the stages' models, so a misspelt
setting fails at load."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

from mm_assets.domain.model.hidden_states import ExtractionSettings
from mm_assets.domain.model.responses import ResponseSettings
from mm_assets.domain.model.settings import (
    BenchmarkSettings,
    MeasurementSettings,
    OnlineSettings,
    SpeculatorSettings,
    TrackingSettings,
)
from mm_assets.domain.prep.settings import TokenizationSettings
from mm_assets.registry import DatasetSpec, DraftSpec, load_drafts, load_registry

M = TypeVar("M", bound=BaseModel)

# The stages a registry entry may set settings of, and the models those come from.
STAGE_SETTINGS: dict[str, tuple[type[BaseModel], ...]] = {
    "tokenized_samples": (TokenizationSettings,),
    "target_responses": (ResponseSettings,),
    "hidden_states": (ExtractionSettings,),
    "trained_speculator": (
        SpeculatorSettings,
        OnlineSettings,
        MeasurementSettings,
        TrackingSettings,
    ),
    "speculator_benchmark": (BenchmarkSettings,),
}


def resolve(
    spec: DatasetSpec | DraftSpec, stage: str, model: type[M], launched: Mapping[str, Any]
) -> M:
    """`model`'s settings of `stage`: its defaults < the entry's < `launched` (only the
    keys actually given: a launch that fills in every default would hide the entry)."""
    values = {**spec.settings.get(stage, {}), **launched}
    return model(**{key: value for key, value in values.items() if key in model.model_fields})


def datasets() -> dict[str, DatasetSpec]:
    """Every registered dataset (built-in entries, then the user's file)."""
    return load_registry(STAGE_SETTINGS)


def drafts(registered: Mapping[str, DatasetSpec]) -> dict[str, DraftSpec]:
    """Every draft: each training dataset's own, then the `drafts:` entries."""
    return load_drafts(registered, STAGE_SETTINGS)
