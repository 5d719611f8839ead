"""Choosing a registered dataset's rows: the entry's filters and a deterministic subsample.

Rows are kept as the JSON text of the record so every format fits one table schema and a
row that fails later is quarantined with its original content. A line that is not JSON
is kept too (with a parse error) instead of aborting the load.

Memory is flat in the source's size: rows arrive one at a time from a reader
(`services/ingest.py`), each kept row goes on to a sink (the table writer) as it is
read, and `max_samples` is applied in two passes (`select_rows`).
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mm_assets.registry import DatasetSpec


@dataclass(frozen=True)
class RawRow:
    source_index: int
    record: Any  # the decoded record, or the raw text when it was not valid JSON
    parse_error: str | None = None
    # the file the row came from: its name under a local directory (or the file's own
    # name), or the `data_files` entry of a hub dataset; a benchmark's category may be it
    source_file: str | None = None

    def record_json(self) -> str:
        if self.parse_error is not None:
            return str(self.record)
        return json.dumps(self.record, ensure_ascii=False, default=str)


MAX_DEPTH = 64
"""Nesting a record may have: a chat row needs under ten levels, and later stages walk
records recursively (a thousand levels exhaust Python's stack)."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def checked(row: RawRow) -> RawRow:
    """The row as a table can hold it, or a parse-error row (quarantined by
    normalization) that says why not: nesting deeper than `MAX_DEPTH`, or text holding a
    lone surrogate, which JSON escapes allow but UTF-8 cannot store. One walk, no
    recursion."""
    if row.parse_error is not None:
        return row
    stack, surrogate = [(row.record, 1)], False
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            surrogate = surrogate or _SURROGATE.search(value) is not None
            continue
        if not isinstance(value, dict | list | tuple):
            continue
        if depth > MAX_DEPTH:
            error = f"nested more than {MAX_DEPTH} levels deep"
            return RawRow(row.source_index, f"<{error}; not stored>", error, row.source_file)
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        stack.extend((item, depth + 1) for item in items)
    if surrogate:
        text = json.dumps(row.record, ensure_ascii=True, default=str)  # escapes survive
        error = "text holds a lone surrogate (not valid Unicode)"
        return RawRow(row.source_index, text, error, row.source_file)
    return row


# -- filters: selected by name from the registry entry -----------------------------


def _image_prefix(prefix: str) -> Callable[[Any], bool]:
    def keep(record: Any) -> bool:
        image = record.get("image") if isinstance(record, dict) else None
        images = image if isinstance(image, list) else [image]
        return any(isinstance(i, str) and i.startswith(prefix) for i in images)

    return keep


FILTERS: dict[str, Callable[[Any], Callable[[Any], bool]]] = {"image_prefix": _image_prefix}


def build_filter(spec: DatasetSpec) -> Callable[[RawRow], bool]:
    """All of the entry's filters at once. A row that is not valid JSON is kept, so it is
    quarantined later with a reason instead of vanishing."""
    checks = []
    for name, argument in spec.filter.items():
        if name not in FILTERS:
            raise ValueError(
                f"dataset {spec.name!r}: unknown filter {name!r}; known: {sorted(FILTERS)}"
            )
        checks.append(FILTERS[name](argument))
    return lambda row: row.parse_error is not None or all(c(row.record) for c in checks)


def sample_positions(count: int, max_samples: int | None, seed: int) -> Sequence[int]:
    """Which of `count` rows a deterministic subsample keeps (positions among the rows
    that passed the filter, ascending). It depends on the count alone, so a counting
    pass is enough to choose; a seed keeps selecting the same rows."""
    if max_samples is None or count <= max_samples:
        return range(count)
    return sorted(random.Random(seed).sample(range(count), max_samples))


@dataclass(frozen=True)
class Selection:
    total: int  # rows in the source (read by a pass)
    after_filter: int
    kept: int


class RowSink(Protocol):
    """Where the rows the selection keeps go, one at a time (the table writer)."""

    def take(self, row: RawRow) -> None:
        """Keeps the row."""

    def discard(self) -> None:
        """The rows taken so far are not kept after all."""


def select_rows(
    spec: DatasetSpec,
    keep: Callable[[RawRow], bool],
    read: Callable[[], Iterator[RawRow]],
    sink: RowSink,
) -> Selection:
    """The entry's rows from `read` (which reads its source from the start each call),
    filtered by `keep` (`build_filter`), then subsampled, into `sink`.

    Holds no row: a first pass counts the rows that pass the filter, giving them to
    `sink` while there are at most `max_samples`; when more pass, `sink` discards them
    and a second pass gives it the chosen positions (a source that changes in between
    is refused)."""
    limit = spec.max_samples
    first = _pass(read(), keep, sink, itertools.count() if limit is None else range(limit), limit)
    if first.kept == first.after_filter:
        return first
    positions = sample_positions(first.after_filter, spec.max_samples, spec.seed)
    second = _pass(read(), keep, sink, positions)
    if (second.total, second.after_filter) != (first.total, first.after_filter):
        raise RuntimeError(
            f"dataset {spec.name!r}: {spec.hub or spec.resolved_path()} changed between its "
            f"two reads ({first.total} rows, {first.after_filter} after the filter, then "
            f"{second.total} and {second.after_filter}); rerun once nothing writes to it"
        )
    return second


def _pass(
    rows: Iterable[RawRow],
    keep: Callable[[RawRow], bool],
    sink: RowSink,
    wanted: Iterable[int],
    limit: int | None = None,
) -> Selection:
    """Counts the rows and those passing `keep`, giving `sink` the passing ones whose
    position among them `wanted` yields (ascending). Once more than `limit` pass, `sink`
    discards what it took: the caller samples them in a second pass."""
    positions = iter(wanted)
    next_wanted = next(positions, None)
    total = after_filter = kept = 0
    for row in rows:
        total += 1
        if not keep(row):
            continue
        if after_filter == next_wanted:
            sink.take(row)
            kept += 1
            next_wanted = next(positions, None)
        elif after_filter == limit and kept:
            kept = 0
            sink.discard()
        after_filter += 1
    return Selection(total, after_filter, kept)
