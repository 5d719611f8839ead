"""Dataset entries read from the built-in YAML and an optional user YAML file.

Each entry is validated against a typed model (`DatasetSpec`) that forbids unknown keys:
a typo (`max_sample:`) must not silently fall back to a default and process the whole
dataset, and a wrong type must be refused when the registry loads, not hours later. Each
problem is one line naming the file, the entry and the field, with what is allowed. An
entry's stage settings (`settings: {stage: {field: value}}`) are checked against the
stage's settings models, which the caller hands in (the registry sits below them).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidationError,
    field_validator,
    model_validator,
)

from mm_assets.common import paths
from mm_assets.common.urls import url_password

DEFAULT_CATEGORY = "all"
# `${VAR}` in an entry's paths names where data lives, never a credential: a path is
# shown in metadata and logs, so variables named like secrets are refused, and so are
# values holding a URL with a password (`DATABASE_URL`) when the path is resolved.
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
DATA_SUFFIXES = {".jsonl", ".json", ".parquet", ".csv", ".gz", ".zst", ".bz2", ".xz"}
# A dataset's or a draft's name becomes a directory (a partition, `speculators/<name>`):
# one plain path component, never `..`, never a hidden file, never an option (`-x`).
_NAME = re.compile(r"^(?!.*\.\.)[A-Za-z0-9_][A-Za-z0-9_.-]*$")
NAME_RULE = "letters, digits, '_', '-' and '.' only, without '..', not starting with '-' or '.'"

DatasetFormat = Literal["sharegpt4v", "sharegpt", "messages", "prompts"]
DatasetRole = Literal["training", "benchmark"]
# the filters `domain.ingest.sources.FILTERS` implements, each taking a string
FilterName = Literal["image_prefix"]
# keys an earlier release knew under another name: refused with the new one
RENAMED = {"max_quarantine_ratio": "max_tokenization_quarantine_ratio"}
# stage name -> the settings models its fields come from (`load_registry(stages)`)
StageSettings = Mapping[str, Sequence[type[BaseModel]]]


class PromptColumns(BaseModel):
    """Where a `prompts`-format record keeps its parts (e.g. MMStar: question, image)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str = Field(
        default="prompt",
        description="the column of the prompt: a string, or a list asked turn after turn",
    )
    image: str | None = Field(
        default=None, description="the column of the prompt's image(s), shown before its text"
    )
    answer: str | None = Field(
        default=None, description="the column of the reference answer(s), if any"
    )


class DatasetSpec(BaseModel):
    """One registered dataset: where its rows come from and how to read them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description=NAME_RULE)
    hub: str | None = Field(default=None, description="a Hugging Face dataset id")
    path: str | None = Field(
        default=None, description="a local json/jsonl/parquet file or a directory of them"
    )
    subset: str | None = Field(default=None, description="the hub dataset's subset (config)")
    split: str = Field(default="train", description="a split name, e.g. train")
    data_files: list[str] | None = Field(
        default=None,
        description="files of the hub dataset (or under the local directory) to read, in "
        "order, e.g. one per subset",
    )
    format: DatasetFormat = Field(
        description="sharegpt4v, sharegpt, messages (TRL's layout with an `images` column "
        "included) or prompts (columns named by `columns`)"
    )
    columns: PromptColumns = Field(
        default_factory=PromptColumns, description="format prompts: {prompt, image, answer}"
    )
    role: DatasetRole = Field(
        default="training",
        description="'training' (a draft is trained on it) or 'benchmark' (prompts drafts "
        "are measured on, per category; prepared but never trained on)",
    )
    category: str | None = Field(
        default=None, description="benchmark: one category for every row of the entry"
    )
    category_column: str | None = Field(
        default=None, description="benchmark: the column holding each row's category"
    )
    category_from_file: bool = Field(
        default=False,
        strict=True,
        description="benchmark: each row's category is the name of its file (without the "
        "suffix), e.g. one file per subset",
    )
    benchmarks: list[str] = Field(
        default_factory=list,
        description="benchmark entries `speculator_benchmark` measures this dataset's draft on",
    )
    filter: dict[FilterName, str] = Field(
        default_factory=dict,
        description="a mapping {filter name: argument}; filters: image_prefix (keep rows "
        "with an image reference starting with the argument)",
    )
    image_root: str | None = Field(
        default=None, description="a directory image references resolve under"
    )
    image_path_strip_prefix: str = Field(
        default="", description="a prefix removed from image references"
    )
    max_samples: int | None = Field(
        default=None,
        gt=0,
        strict=True,
        description="a positive whole number of rows to keep; leave it out to keep all",
    )
    seed: int = Field(default=0, strict=True, description="a whole number")
    min_image_availability: FiniteFloat = Field(
        default=0.95, ge=0.0, le=1.0, strict=True, description="a fraction from 0 to 1"
    )
    min_supervised_tokens: int = Field(
        default=1,
        ge=1,
        strict=True,
        description="a positive whole number: rows whose loss reads fewer tokens besides "
        "the tokenizer's special tokens (the end-of-turn marker) are quarantined",
    )
    max_tokenization_quarantine_ratio: FiniteFloat = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        strict=True,
        description="a fraction from 0 to 1: the tokenized_samples check fails when more "
        "of the conversations than this are quarantined",
    )
    responses: Literal["dataset", "target"] = Field(
        default="dataset",
        description="'target' (the target rewrites every assistant turn: on-policy "
        "training data) or 'dataset' (train on the dataset's own answers)",
    )
    settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="a mapping {stage: {setting: value}}: the stage's settings for this "
        "dataset (launch config still overrides them)",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return checked_name(value, "a dataset")

    @field_validator("path", "image_root")
    @classmethod
    def _no_secret_variable(cls, value: str | None) -> str | None:
        for name in re.findall(r"\$\{(\w+)\}", value or ""):
            if SECRET_NAME.search(name):
                raise ValueError(
                    f"${{{name}}} names a secret's variable: a path shows in metadata and "
                    "logs; write the path out"
                )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if (self.hub is None) == (self.path is None):
            given = "both are given" if self.hub is not None else "neither is given"
            raise ValueError(
                f"give exactly one of 'hub' (a hub dataset id) or 'path' (a local file or "
                f"directory); {given}"
            )
        named = [self.category, self.category_column]
        ways = [*(way is not None for way in named), self.category_from_file]
        if sum(ways) > 1:
            raise ValueError(
                "give at most one of 'category', 'category_column' and 'category_from_file'"
            )
        if any(ways) and self.role != "benchmark":
            raise ValueError("categories are for benchmarks: add 'role: benchmark'")
        if self.benchmarks and self.role == "benchmark":
            why = "'benchmarks' lists what a draft is measured on: a benchmark has no draft"
            raise ValueError(f"{why}; remove it")
        return self

    @property
    def is_benchmark(self) -> bool:
        return self.role == "benchmark"

    def category_of(self, record: Mapping[str, Any], source_file: str | None) -> str:
        """A benchmark row's category: the entry's one value, its column or its file's
        name (`DEFAULT_CATEGORY` when none is set or the row holds none)."""
        if self.category is not None:
            return self.category
        if self.category_from_file and source_file:
            return _file_category(Path(source_file))
        if self.category_column is not None:
            value = record.get(self.category_column)
            if value is not None and str(value).strip():
                return str(value)
        return DEFAULT_CATEGORY

    def resolved_image_root(self) -> Path:
        """The directory image references resolve under: the entry's, else `$COCO_DIR`."""
        root = self.image_root or os.environ.get("COCO_DIR") or str(paths.home() / "coco")
        return Path(_expand(root)).expanduser().resolve()

    def resolved_path(self) -> Path:
        if self.path is None:
            raise ValueError(f"dataset {self.name!r} has no local path (it is a hub dataset)")
        return Path(_expand(self.path)).expanduser()


def checked_name(value: str, what: str) -> str:
    """`value` when it is a valid entry name (`_NAME`), else why not."""
    if not _NAME.match(value):
        raise ValueError(f"{what} name may hold {NAME_RULE}")
    return value


def _expand(value: str) -> str:
    env = dict(os.environ)
    env.setdefault("MM_ASSETS_HOME", str(paths.home()))

    def variable(match: re.Match[str]) -> str:
        found = env.get(match.group(1), match.group(0))
        if url_password(found):
            raise ValueError(
                f"{match.group(0)} holds a URL with a password: a path shows in metadata "
                "and logs; write the path out"
            )
        return found

    return re.sub(r"\$\{(\w+)\}", variable, value)


def _known_keys() -> list[str]:
    """The keys an entry may hold, in declaration order (the name is the entry's key)."""
    return [key for key in DatasetSpec.model_fields if key != "name"]


def _unknown_key(key: Any, known: Sequence[str] | None = None, where: str = "key") -> str:
    if key in RENAMED and known is None:
        return f"{key!r} is now called {RENAMED[key]!r}: rename the key"
    known = list(known) if known is not None else _known_keys()
    return f"unknown {where} {key!r} ({did_you_mean(key, known)}known: {', '.join(known)})"


def did_you_mean(word: Any, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word), list(known), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def stage_problems(settings: Any, stages: StageSettings) -> list[str]:
    """`settings` checked against each stage's models: the stage must exist, every field
    must belong to one of its models and hold a value that model accepts."""
    if not isinstance(settings, dict):
        return [
            f"'settings': expected a mapping {{stage: {{setting: value}}}}, got {_got(settings)}"
        ]
    problems = []
    for stage, values in settings.items():
        where = f"settings.{stage}"
        if stage not in stages:
            problems.append(f"{where!r}: " + _unknown_key(stage, list(stages), "stage"))
            continue
        if not isinstance(values, dict):
            problems.append(f"{where!r}: expected a mapping of settings, got {_got(values)}")
            continue
        models = stages[stage]
        fields = [name for model in models for name in model.model_fields]
        problems += [
            f"{where!r}: " + _unknown_key(key, fields, "setting")
            for key in values
            if key not in fields
        ]
        for model in models:
            mine = {key: value for key, value in values.items() if key in model.model_fields}
            try:
                model.model_validate(mine)
            except ValidationError as exc:
                problems += [describe_error(error, model, f"{where}.") for error in exc.errors()]
    return problems


def _got(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_error(
    error: Mapping[str, Any], model: type[BaseModel] = DatasetSpec, prefix: str = ""
) -> str:
    """One pydantic error as `'field': what is wrong, got X (allowed: ...)`."""
    loc = error["loc"]
    kind = error["type"]
    message = error["msg"]
    if kind == "value_error":
        message = str(error.get("ctx", {}).get("error", message))
    message = message[:1].lower() + message[1:]
    if not loc:  # a check across fields
        return message
    field = loc[0]
    if kind == "extra_forbidden" and len(loc) == 1:
        if model is DatasetSpec:
            return _unknown_key(field)
        return f"{prefix}{field}: " + _unknown_key(field, list(model.model_fields))
    info = model.model_fields.get(str(field))
    allowed = info.description if info is not None else None
    where = prefix + ".".join(str(part) for part in loc if part != "[key]")
    if kind == "missing":
        return f"{where!r} is required" + (f" ({allowed})" if allowed else "")
    if "[key]" in loc:  # a mapping's key, e.g. a filter name
        return f"{where!r}: unknown name {_got(error.get('input'))} ({allowed})"
    text = f"{where!r}: {message}, got {_got(error.get('input'))}"
    if allowed and kind != "literal_error":
        text += f" (allowed: {allowed})"
    return text


def parse_entries(
    entries: Any, origin: str, stages: StageSettings | None = None
) -> dict[str, DatasetSpec]:
    """Validate raw YAML entries; each problem is one line naming the file and the entry.
    With `stages`, each entry's `settings` are checked against the stages' models.

    All entries are checked before raising, so one pass shows everything to fix.
    """
    if not isinstance(entries, dict):
        raise ValueError(f"{origin}: expected a mapping of dataset name -> entry")
    specs: dict[str, DatasetSpec] = {}
    problems: list[str] = []
    for name, entry in entries.items():
        where = f"{origin}: dataset {name!r}"
        if not isinstance(entry, dict):
            problems.append(f"{where}: expected a mapping of keys, got {type(entry).__name__}")
            continue
        lines = []
        if "name" in entry:
            lines.append(
                f"unknown key 'name' (the dataset's name is its key in the file; "
                f"known: {', '.join(_known_keys())})"
            )
        data = {key: value for key, value in entry.items() if key != "name"}
        if stages is not None and "settings" in data:
            settings_problems = stage_problems(data["settings"], stages)
            if settings_problems:
                lines.extend(settings_problems)
                data.pop("settings")  # reported once, not again by the type check
        try:
            spec = DatasetSpec.model_validate({"name": name, **data})
        except ValidationError as exc:
            lines.extend(describe_error(error) for error in exc.errors())
        else:
            if not lines:
                specs[name] = spec
        problems.extend(f"{where}: {line}" for line in lines)
    if problems:
        raise ValueError("\n".join(problems))
    return specs


def _file_category(path: Path) -> str:
    """A file's name without its data suffixes: `v1.2_math.jsonl.gz` is `v1.2_math`."""
    while path.suffix.lower() in DATA_SUFFIXES:
        path = path.with_suffix("")
    return path.name
