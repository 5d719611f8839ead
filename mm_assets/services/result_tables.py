"""The tables of a draft's results (`speculator_benchmarks` and the requests behind it,
`draft_measurements`): each keeps every measurement a draft has had, so drafts and
retrainings compare in DuckDB.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mm_assets.storage import TableStore, schemas

SCHEMAS = {
    "speculator_benchmarks": schemas.SPECULATOR_BENCHMARKS,
    "speculator_benchmark_prompts": schemas.SPECULATOR_BENCHMARK_PROMPTS,
    "draft_measurements": schemas.DRAFT_MEASUREMENTS,
}


def write_results(
    tables: TableStore,
    table: str,
    draft: str,
    key: str,
    rows: Iterable[Mapping[str, Any]],
    reused: bool,
) -> int:
    """The draft's partition of `table`: its earlier measurements (other keys) kept, this
    one's rows (`key`) written in place of any it had — unless the figures were `reused`
    from a record and the table holds them already (their `measured_at` stays the time
    they were measured). Returns the rows written."""
    earlier = list(tables.iter_rows(table, draft)) if tables.exists(table, draft) else []
    if reused and any(r["measurement"] == key for r in earlier):
        return 0
    earlier = [r for r in earlier if r["measurement"] != key]
    new = [{**row, "measurement": key} for row in rows]
    tables.write(table, draft, [*earlier, *new], SCHEMAS[table])
    return len(new)
