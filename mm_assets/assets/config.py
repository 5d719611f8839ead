"""Dagster config classes generated from the settings models the services use, so a
setting is declared once (name, type, default, bounds, description) and the UI's config
editor, the CLI and the services all read that one declaration."""

from __future__ import annotations

from typing import Any, TypeVar

import dagster as dg
from pydantic import BaseModel, create_model
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)


def config_class(
    name: str, *models: type[BaseModel], **extra: tuple[Any, FieldInfo]
) -> type[dg.Config]:
    """A `dg.Config` with every field of `models`, plus `extra` fields `(type, Field(...))`."""
    fields: dict[str, Any] = {}
    for model in models:
        for field_name, info in model.model_fields.items():
            fields[field_name] = (info.annotation, info)
    fields.update(extra)
    return create_model(name, __base__=dg.Config, **fields)


def settings_from(config: dg.Config, model: type[M]) -> M:
    """The settings model's part of a generated config."""
    return model(**config.model_dump(include=set(model.model_fields)))
