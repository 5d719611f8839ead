"""Draft entries: a draft is trained on several registered datasets (its sources), each
capped, read from the `drafts:` section of the same YAML files as the datasets.

    drafts:
      vlm_chat:
        sources: {sharegpt4v_coco: {max_rows: 30000}, ultrachat: {fraction: 0.5}}
        epochs: 4            # any trained_speculator setting
        speculator_benchmark: {max_tokens: 64}   # how it is benchmarked

A draft is benchmarked on the benchmarks its sources list (`benchmarks:`). Every dataset
is also a one-source draft of its own name, so a draft's name may not be a dataset's.
Entries are checked when the registry loads, like datasets: a name that is not one plain
directory name (`../x`, `a/b`), an unknown source or key, a bad cap, or sources whose
states cannot be trained on together (other layer ids; states fetched online for a draft
that reads stored ones) are refused with a line naming the file, the draft and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidationError,
    field_validator,
    model_validator,
)

from mm_assets.registry.loading import DRAFTS_KEY, registry_documents
from mm_assets.registry.specs import (
    NAME_RULE,
    DatasetSpec,
    StageSettings,
    checked_name,
    describe_error,
    did_you_mean,
    stage_problems,
)

STAGE = "trained_speculator"  # the stage whose settings a draft entry sets at its top level
BENCHMARK_STAGE = "speculator_benchmark"  # and the one it may set under its name


class SourceCap(BaseModel):
    """How much of one source a draft takes (all of it by default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_rows: int | None = Field(
        default=None, gt=0, strict=True, description="at most this many training rows"
    )
    fraction: FiniteFloat | None = Field(
        default=None, gt=0, le=1, description="this share of the rows, from 0 to 1"
    )

    @model_validator(mode="after")
    def _one_cap(self) -> SourceCap:
        if self.max_rows is not None and self.fraction is not None:
            raise ValueError("give max_rows or fraction, not both")
        return self


class DraftSpec(BaseModel):
    """One draft: its sources and their caps, and its `trained_speculator` settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description=NAME_RULE)
    sources: dict[str, SourceCap] = Field(
        min_length=1, description="a mapping {dataset name: {max_rows | fraction}}"
    )
    settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    benchmarks: tuple[str, ...] = Field(
        default=(), description="the benchmark entries it is measured on: its sources' own"
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return checked_name(value, "a draft")

    @property
    def is_dataset(self) -> bool:
        """A dataset's own draft: one source of the same name, uncapped."""
        return list(self.sources) == [self.name] and self.sources[self.name] == SourceCap()

    @classmethod
    def of_dataset(cls, spec: DatasetSpec) -> DraftSpec:
        return cls(
            name=spec.name,
            sources={spec.name: SourceCap()},
            settings=spec.settings,
            benchmarks=tuple(spec.benchmarks),
        )


def parse_drafts(
    entries: Any, origin: str, datasets: Mapping[str, DatasetSpec], stages: StageSettings
) -> dict[str, DraftSpec]:
    """Validate raw `drafts:` entries against the datasets; all problems in one error."""
    if entries is None:
        return {}
    if not isinstance(entries, dict):
        raise ValueError(f"{origin}: 'drafts': expected a mapping of draft name -> entry")
    drafts, problems = {}, []
    for name, entry in entries.items():
        lines = _draft_problems(name, entry, datasets, stages)
        if not lines:
            sources = [datasets[s] for s in entry["sources"]]
            drafts[name] = DraftSpec(
                name=name,
                sources=entry["sources"],
                settings=_entry_settings(entry),
                benchmarks=tuple(dict.fromkeys(b for s in sources for b in s.benchmarks)),
            )
        problems += [f"{origin}: draft {name!r}: {line}" for line in lines]
    if problems:
        raise ValueError("\n".join(problems))
    return drafts


def _draft_problems(
    name: Any, entry: Any, datasets: Mapping[str, DatasetSpec], stages: StageSettings
) -> list[str]:
    if not isinstance(name, str):
        return [f"a draft's name is text, got {type(name).__name__}"]
    try:
        checked_name(name, "a draft")
    except ValueError as exc:  # its directory would lie elsewhere (`../x`, `a/b`)
        return [str(exc)]
    if name in datasets:
        return ["a dataset has this name (every dataset is already a draft of its own)"]
    if not isinstance(entry, dict) or not isinstance(entry.get("sources"), dict):
        return ["expected a mapping with 'sources': {dataset name: {max_rows | fraction}}"]
    lines = [
        line.replace(f"settings.{STAGE}.", "").replace(f"'settings.{STAGE}': ", "")
        for line in stage_problems(_entry_settings(entry), stages)
    ]
    for source, cap in entry["sources"].items():
        if source not in datasets:
            hint = did_you_mean(source, list(datasets))
            lines.append(
                f"'sources.{source}': unknown dataset ({hint}known: {', '.join(datasets)})"
            )
            continue
        if datasets[source].is_benchmark:
            lines.append(f"'sources.{source}': a benchmark is never trained on")
            continue
        try:
            SourceCap.model_validate(cap or {})
        except ValidationError as exc:
            lines += [describe_error(e, SourceCap, f"sources.{source}.") for e in exc.errors()]
    known = [datasets[s] for s in entry["sources"] if s in datasets]
    layer_ids = {str(s.settings.get("hidden_states", {}).get("layer_ids")) for s in known}
    if len(layer_ids) > 1:
        lines.append(
            f"'sources': their hidden_states layer_ids differ ({', '.join(sorted(layer_ids))}); "
            "a draft trains on one set of layers: give every source the same layer_ids"
        )
    online = [s.name for s in known if s.settings.get(STAGE, {}).get("hidden_states") == "online"]
    if online and entry.get("hidden_states") != "online":
        lines.append(
            f"'sources': {', '.join(online)} fetch hidden states online (nothing is stored "
            "for them): set hidden_states: online for the draft too, or store theirs"
        )
    return lines


def _entry_settings(entry: dict[str, Any]) -> dict[str, Any]:
    """A draft entry's settings by stage: its top-level keys are `trained_speculator`'s."""
    top = {k: v for k, v in entry.items() if k not in ("sources", BENCHMARK_STAGE)}
    nested = {BENCHMARK_STAGE: entry[BENCHMARK_STAGE]} if BENCHMARK_STAGE in entry else {}
    return ({STAGE: top} if top else {}) | nested


def load_drafts(datasets: Mapping[str, DatasetSpec], stages: StageSettings) -> dict[str, DraftSpec]:
    """Every training dataset as its own draft, then the files' `drafts:` sections (built-in, then
    the user's, adding or replacing drafts)."""
    drafts = {
        name: DraftSpec.of_dataset(spec) for name, spec in datasets.items() if not spec.is_benchmark
    }
    for origin, document in registry_documents():
        if isinstance(document, dict):
            drafts.update(parse_drafts(document.get(DRAFTS_KEY), origin, datasets, stages))
    return drafts
