"""Reading the registry's files: the built-in `datasets.yaml`, then the user's
(`MM_ASSETS_DATASETS`), each entry parsed into a `DatasetSpec` (`specs.py`) and the
entries checked together (a training entry's benchmarks must be benchmark entries)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from mm_assets.common import paths
from mm_assets.registry.specs import DatasetSpec, StageSettings, did_you_mean, parse_entries

BUILTIN_FILE = "datasets.yaml"


def user_registry_file() -> Path:
    return Path(
        os.environ.get("MM_ASSETS_DATASETS", str(paths.home() / "datasets.yaml"))
    ).expanduser()


def _read_yaml(text: str, origin: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{origin}: not valid YAML: {exc}") from exc


DRAFTS_KEY = "drafts"  # the section of drafts (`registry/drafts.py`), not a dataset


def registry_documents() -> list[tuple[str, dict[str, Any]]]:
    """The built-in file and the user's (when present), each as (origin, its mapping)."""
    text = resources.files("mm_assets.registry").joinpath(BUILTIN_FILE).read_text()
    documents = [(f"built-in {BUILTIN_FILE}", _read_yaml(text, f"built-in {BUILTIN_FILE}"))]
    user_file = user_registry_file()
    if user_file.is_file():
        documents.append((str(user_file), _read_yaml(user_file.read_text(), str(user_file)) or {}))
    return documents


def load_registry(stages: StageSettings | None = None) -> dict[str, DatasetSpec]:
    """Built-in entries, then the user's file (when present) adding or replacing entries;
    with `stages`, the entries' `settings` are checked against those stages' models."""
    specs: dict[str, DatasetSpec] = {}
    for origin, document in registry_documents():
        entries = (
            {k: v for k, v in document.items() if k != DRAFTS_KEY}
            if isinstance(document, dict)
            else document
        )
        specs.update(parse_entries(entries, origin, stages))
    problems = benchmark_problems(specs)
    if problems:
        raise ValueError("\n".join(problems))
    return specs


def benchmark_problems(specs: Mapping[str, DatasetSpec]) -> list[str]:
    """A training entry's `benchmarks` must name benchmark entries."""
    problems = []
    benchmarks = sorted(n for n, s in specs.items() if s.is_benchmark)
    for name, spec in specs.items():
        for bench in spec.benchmarks:
            if bench in benchmarks:
                continue
            hint = did_you_mean(bench, benchmarks)
            what = "a training dataset" if bench in specs else "not an entry"
            problems.append(
                f"dataset {name!r}: 'benchmarks': {bench!r} is {what} ({hint}benchmark "
                f"entries, with 'role: benchmark': {', '.join(benchmarks) or 'none'})"
            )
    return problems
