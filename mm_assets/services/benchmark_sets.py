"""A benchmark's prompts by category, and the key of a measurement on it.

The prompts are the benchmark partition's normalized conversations (`role: benchmark`
entries are prepared like any dataset: images probed, bad rows quarantined).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mm_assets.common.hashing import json_sha256
from mm_assets.domain.model.acceptance import OVERALL
from mm_assets.domain.prep.conversations import Turn
from mm_assets.registry.specs import DEFAULT_CATEGORY
from mm_assets.storage import TableStore


@dataclass(frozen=True)
class BenchmarkSet:
    """One benchmark's conversations, by category (in the order categories first appear)."""

    name: str
    categories: dict[str, list[list[Turn]]]
    images: bool

    @property
    def conversations(self) -> int:
        return sum(len(c) for c in self.categories.values())


def load_benchmark(
    tables: TableStore, benchmark: str, per_category: int | None = None
) -> BenchmarkSet:
    """The benchmark partition's conversations by category, the first `per_category` of
    each (all when None). Fails with what to run when the benchmark is not prepared."""
    if not tables.exists("normalized_conversations", benchmark):
        raise FileNotFoundError(
            f"benchmark {benchmark!r} is not prepared: materialize its partition first "
            f"(`dagster asset materialize -m mm_assets.definitions --select "
            f"'+normalized_conversations' --partition {benchmark}`, or the prepare job)"
        )
    categories: dict[str, list[list[Turn]]] = {}
    images = False
    columns = ["turns", "category", "multimodal"]
    for row in tables.iter_rows("normalized_conversations", benchmark, columns):
        found = categories.setdefault(category_name(row["category"]), [])
        if per_category is None or len(found) < per_category:
            found.append(json.loads(row["turns"]))
            images = images or bool(row["multimodal"])
    return BenchmarkSet(benchmark, categories, images)


def category_name(stored: str | None) -> str:
    """The category a benchmark row is reported under: `overall` names the row that sums
    every category, so a category of that name is reported as `overall (category)`."""
    name = stored or DEFAULT_CATEGORY
    return f"{OVERALL} (category)" if name == OVERALL else name


def results_key(draft_sha256: str | None, benchmark: str, settings: Mapping[str, Any]) -> str:
    """What makes two measurements the same one: reruns of it replace its rows."""
    return json_sha256([draft_sha256, benchmark, dict(settings)])[:16]
