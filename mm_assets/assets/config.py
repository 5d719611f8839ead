"""Dagster config classes generated from the settings models the services use, so a
setting is declared once (name, type, default, bounds, description) for the UI's config
editor, the CLI and the services.

A setting's value comes from, last wins: the model's default, the dataset's registry
entry (`settings: {stage: {...}}`), the config the run was launched with. Dagster fills
every default into the config object, so the launched keys are read from the run's own
config: only keys a user actually launched with override the entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import dagster as dg
from pydantic import BaseModel, create_model
from pydantic.fields import FieldInfo

from mm_assets.registry import DatasetSpec, DraftSpec
from mm_assets.services.settings import resolve

M = TypeVar("M", bound=BaseModel)


def config_class(
    name: str, stage: str, *models: type[BaseModel], **extra: tuple[Any, FieldInfo]
) -> type[dg.Config]:
    """A `dg.Config` with every field of `models` (the description says where else the
    value may come from), plus `extra` fields `(type, Field(...))` that only a launch sets."""
    fields: dict[str, Any] = {}
    for model in models:
        for field_name, info in model.model_fields.items():
            note = f" (registry entry: settings.{stage}.{field_name})"
            described = FieldInfo.merge_field_infos(info, description=f"{info.description}{note}")
            fields[field_name] = (info.annotation, described)
    fields.update(extra)
    return create_model(name, __base__=dg.Config, **fields)


def resource_base(name: str, *models: type[BaseModel]) -> type[dg.ConfigurableResource]:
    """A `dg.ConfigurableResource` base with every field of `models`, to subclass."""
    fields = {key: (info.annotation, info) for m in models for key, info in m.model_fields.items()}
    return create_model(name, __base__=dg.ConfigurableResource, **fields)


def stage_settings(
    context: dg.AssetExecutionContext,
    spec: DatasetSpec | DraftSpec,
    stage: str,
    model: type[M],
    op: str | None = None,
) -> M:
    """`model`'s settings of `stage` for this run (`services.settings.resolve`), the
    launched keys read from the run's config without Dagster's defaults. A step may
    read another stage's settings: the `hidden_states` step reads whether
    `trained_speculator` fetches states online. `op`: the step launched with the
    stage's settings, when it is not named after the stage (`trained_draft` takes
    `trained_speculator` settings)."""
    ops: Mapping[str, Any] = context.run.run_config.get("ops") or {}
    launched = (ops.get(op or stage) or {}).get("config") or {}
    return resolve(spec, stage, model, launched)
