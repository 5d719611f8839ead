"""Loading local and hub-style sources, filters and deterministic subsampling."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mm_assets.domain.ingest.sources import RawRow, build_filter, sample_positions
from mm_assets.registry import DatasetSpec
from mm_assets.services import ingest as sources
from mm_assets.services.ingest import hub_source, load_rows, read_local


class KeptRows:
    """A sink holding the kept rows in a list (`RowSink`)."""

    def __init__(self) -> None:
        self.rows: list[RawRow] = []

    def take(self, row: RawRow) -> None:
        self.rows.append(row)

    def discard(self) -> None:
        self.rows.clear()


@dataclass(frozen=True)
class _Loaded:
    rows: list[RawRow]
    total: int
    after_filter: int


def _load(spec: DatasetSpec) -> _Loaded:
    kept = KeptRows()
    selected = load_rows(spec, kept)
    assert selected.kept == len(kept.rows)
    return _Loaded(kept.rows, selected.total, selected.after_filter)


def test_jsonl_keeps_unparseable_lines_as_rows(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\nnot json\n\n{"a": 2}\n')
    rows = list(read_local(path))
    assert [r.source_index for r in rows] == [0, 1, 2]
    assert rows[1].parse_error and rows[1].record == "not json"
    assert rows[2].record == {"a": 2}


def test_directory_reads_all_files_in_name_order(tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text(json.dumps([{"x": 3}]))
    (tmp_path / "a.jsonl").write_text('{"x": 1}\n{"x": 2}\n')
    assert [(r.source_index, r.record["x"]) for r in read_local(tmp_path)] == [
        (0, 1),
        (1, 2),
        (2, 3),
    ]


def test_subsample_is_deterministic_and_keeps_source_order() -> None:
    a = list(sample_positions(100, 10, seed=3))
    assert len(a) == 10 and a == sorted(a)
    assert a == list(sample_positions(100, 10, seed=3))
    assert a != list(sample_positions(100, 10, seed=4))
    assert list(sample_positions(100, None, 0)) == list(range(100))


def test_image_prefix_filter_then_subsample(tmp_path: Path) -> None:
    records = [{"image": f"{'coco' if i % 2 else 'sam'}/{i}.jpg"} for i in range(20)]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records))
    spec = DatasetSpec(
        name="d",
        format="sharegpt4v",
        path=str(path),
        filter={"image_prefix": "coco/"},
        max_samples=4,
    )
    loaded = _load(spec)
    assert (loaded.total, loaded.after_filter, len(loaded.rows)) == (20, 10, 4)
    assert all(r.record["image"].startswith("coco/") for r in loaded.rows)
    keep = build_filter(spec)
    assert not keep(next(iter(read_local(path))))  # row 0 is sam/


def test_hub_code_path_reads_through_load_dataset(tmp_path: Path) -> None:
    """The same `datasets.load_dataset(path, name=..., split=...)` call as for a hub id,
    here on a local directory (no hub is reachable from these machines)."""
    (tmp_path / "train.jsonl").write_text('{"q": "a"}\n{"q": "b"}\n')
    rows = list(hub_source(str(tmp_path), None, "train")())
    assert [r.record["q"] for r in rows] == ["a", "b"]


def _mixed_records(count: int) -> list[dict]:
    """Every third record is a `sam/` image, which the `coco/` filter drops."""
    return [
        {"id": i, "image": f"{'sam' if i % 3 == 0 else 'coco'}/{i}.jpg", "score": i / 7}
        for i in range(count)
    ]


def _spec(path: Path, max_samples: int | None, seed: int = 0) -> DatasetSpec:
    return DatasetSpec(
        name="d",
        format="sharegpt4v",
        path=str(path),
        filter={"image_prefix": "coco/"},
        max_samples=max_samples,
        seed=seed,
    )


@pytest.mark.parametrize("count", [40, 301])
@pytest.mark.parametrize("seed", [0, 1, 17])
@pytest.mark.parametrize("max_samples", [1, 13, 26, 27, 500, None])
def test_streaming_selection_equals_sampling_the_filtered_list(
    tmp_path: Path, count: int, seed: int, max_samples: int | None
) -> None:
    """The two-pass selection keeps exactly the rows the in-memory formula kept, so no
    existing partition's rows (or their source_index) change."""
    records = _mixed_records(count)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    filtered = [(i, r) for i, r in enumerate(records) if r["image"].startswith("coco/")]
    if max_samples is None or len(filtered) <= max_samples:
        expected = filtered
    else:
        chosen = sorted(random.Random(seed).sample(range(len(filtered)), max_samples))
        expected = [filtered[i] for i in chosen]

    loaded = _load(_spec(path, max_samples, seed))

    assert [(r.source_index, r.record) for r in loaded.rows] == expected
    assert (loaded.total, loaded.after_filter) == (count, len(filtered))


@pytest.mark.parametrize(("max_samples", "reads"), [(None, 1), (13, 1), (12, 2), (3, 2)])
def test_the_source_is_read_twice_only_when_it_is_subsampled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_samples: int | None, reads: int
) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps(_mixed_records(20)))  # 13 rows pass the filter
    calls: list[Path] = []
    real = sources.read_local

    def counted(p: Path, *data_files: list[str]) -> Iterator[RawRow]:
        calls.append(p)
        return real(p, *data_files)

    monkeypatch.setattr(sources, "read_local", counted)

    loaded = _load(_spec(path, max_samples))

    assert len(calls) == reads
    assert len(loaded.rows) == min(13, max_samples or 13)


def test_a_source_that_changes_between_the_two_reads_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _mixed_records(20)))
    real = sources.read_local

    def growing(p: Path, *data_files: list[str]) -> Iterator[RawRow]:
        yield from real(p, *data_files)
        path.write_text(path.read_text() + json.dumps({"image": "coco/new.jpg"}) + "\n")

    monkeypatch.setattr(sources, "read_local", growing)
    with pytest.raises(RuntimeError, match="changed between its two reads"):
        _load(_spec(path, 5))


def test_json_list_and_jsonl_give_the_same_rows_as_json_loads(tmp_path: Path) -> None:
    """The streaming list reader decodes numbers and text as `json.loads` does, so the
    stored `record` text is what it was when the whole file was loaded at once."""
    records = [
        {"id": 1, "f": 1.0, "e": 1e5, "tiny": 5e-324, "neg": -0.0, "big": 2**62, "sum": 0.1 + 0.2},
        {"text": 'café ☃ 😀 \u0000\t"q"', "nested": [None, True, [], {"k": [1.5, "x"]}]},
        "a bare string",
        42,
    ]
    as_list, as_lines = tmp_path / "d.json", tmp_path / "d.jsonl"
    as_list.write_text(json.dumps(records, indent=2, ensure_ascii=True))
    as_lines.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    expected = [(i, json.dumps(r, ensure_ascii=False)) for i, r in enumerate(records)]

    for path in (as_list, as_lines):
        assert [(r.source_index, r.record_json()) for r in read_local(path)] == expected
    first = next(read_local(as_list)).record
    assert {k: type(v) for k, v in first.items()} == {k: type(v) for k, v in records[0].items()}


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ('[{"a": 1}, {"a": 2}, {"a": ]', "after record 2"),
        ('[{"a": 1}', "after record 1"),
        ('[{"a": 1}] trailing', "after record 1"),
        ('[{"a": NaN}]', "after record 0"),
        ('{"a": [{"b": 1}]}', "holds an object"),
        ("  \n", "holds nothing"),
    ],
)
def test_a_malformed_json_list_names_the_file(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "broken.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=says) as error:
        list(read_local(path))
    assert str(path) in str(error.value)
    assert ".jsonl" in str(error.value)  # the way out when the file is otherwise fine


def test_a_json_list_the_fast_parser_refuses_is_read_on_exactly(tmp_path: Path) -> None:
    """Integers beyond 64 bits and unpaired surrogate escapes are valid JSON that ijson's
    C parser refuses: the rest of the file is read with the exact parser, no row lost,
    and the surrogate's row quarantined (UTF-8 cannot store it) with its text escaped."""
    path = tmp_path / "d.json"
    path.write_text(
        '[{"a": 1}, {"t": "\\udc00"}, {"big": 123456789012345678901234567890}, '
        '{"s": "\\ud800x"}, {"b": 2}]'
    )
    spec = DatasetSpec(name="d", path=str(path), format="sharegpt")
    rows = _load(spec).rows
    assert rows[0].record == {"a": 1}
    assert rows[2].record == {"big": 123456789012345678901234567890}
    assert rows[1].parse_error and "surrogate" in rows[1].parse_error
    assert rows[3].parse_error and "surrogate" in rows[3].parse_error
    assert json.loads(rows[3].record) == {"s": "\ud800x"}
    assert rows[4].record == {"b": 2}


def test_crafted_jsonl_lines_become_rows_with_reasons_not_errors(tmp_path: Path) -> None:
    """A lone surrogate (in a key or a value), bytes that are not UTF-8 (its line named),
    and nesting of 800 and 100,000 levels: each is a row with a parse error, the good
    rows around them kept."""
    lines = [
        b'{"ok": 1}',
        b'{"text": "\\udc00"}',
        b'{"\\ud800": 1}',
        b'{"text": "\xff\xfe"}',
        b'{"deep": ' + b"[" * 800 + b"]" * 800 + b"}",
        b'{"deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"ok": 2}',
    ]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    rows = _load(DatasetSpec(name="d", path=str(path), format="sharegpt")).rows
    assert [r.parse_error is None for r in rows] == [True, False, False, False, False, False, True]
    errors = [r.parse_error for r in rows[1:-1]]
    assert "surrogate" in errors[0] and "surrogate" in errors[1]
    assert errors[2].startswith("line 4: not UTF-8")
    assert "levels deep" in errors[3] and "too deep" in errors[4]
    assert all(r.record_json().encode("utf-8") for r in rows)  # every row can be stored


def test_the_registry_allows_exactly_the_filters_implemented() -> None:
    from typing import get_args

    from mm_assets.domain.ingest.sources import FILTERS
    from mm_assets.registry.specs import FilterName

    assert set(FILTERS) == set(get_args(FilterName))


@pytest.mark.parametrize("max_samples", [None, 1500])
def test_kept_rows_reach_the_table_in_batches_while_the_source_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_samples: int | None
) -> None:
    """`raw_dataset` holds no more than a batch of kept rows: batches are written while
    the source is still being read (both passes of a subsample: its first pass writes
    1,024 rows before learning that 2,000 pass, and starts the file over), and the table
    is byte for byte the one written from the selected rows at once."""
    from mm_assets.services.ingest import load_raw_dataset
    from mm_assets.storage import TableStore, schemas
    from mm_assets.storage.tables import BatchWriter

    records = _mixed_records(3000)  # 2,000 pass the filter
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    read = {"rows": 0}
    flushed_after: list[int] = []  # source rows read when each batch was written
    real_read, real_flush = sources.read_local, BatchWriter.flush

    def counted(p: Path, *data_files: list[str]) -> Iterator[RawRow]:
        for row in real_read(p, *data_files):
            read["rows"] += 1
            yield row

    def flush(self: BatchWriter) -> None:
        if self._pending:
            flushed_after.append(read["rows"])
        real_flush(self)

    monkeypatch.setattr(sources, "read_local", counted)
    monkeypatch.setattr(BatchWriter, "flush", flush)
    tables = TableStore(tmp_path / "store")

    report = load_raw_dataset(_spec(path, max_samples, seed=5), tables, tmp_path / "images")

    passes = 1 if max_samples is None else 2
    assert read["rows"] == 3000 * passes
    during_a_read = [n for n in flushed_after if n % 3000 != 0]
    assert len(during_a_read) >= passes, flushed_after
    filtered = [(i, r) for i, r in enumerate(records) if r["image"].startswith("coco/")]
    positions = range(2000) if max_samples is None else random.Random(5).sample(range(2000), 1500)
    chosen = [filtered[i] for i in sorted(positions)]
    at_once = tables.write(
        "raw_dataset",
        "at_once",
        (
            {
                "source_index": i,
                "record": json.dumps(r, ensure_ascii=False),
                "parse_error": None,
                "source_file": "d.jsonl",
            }
            for i, r in chosen
        ),
        schemas.RAW_DATASET,
    )
    assert report.written.num_rows == len(chosen)
    assert report.written.content_hash == at_once.content_hash
    assert tables.read("raw_dataset", "d").equals(tables.read("raw_dataset", "at_once"))


def test_parquet_rows_carrying_images_of_a_few_mib_are_read_one_at_a_time(
    tmp_path: Path,
) -> None:
    """Arrow holds one 5 MiB row (and its page) while it is in hand, not a batch of
    four: a hub dataset's rows carry their images, and a batch of them is its size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    mib = 1 << 20
    rows = [{"image": {"bytes": bytes([i]) * (5 * mib), "path": f"{i}.png"}} for i in range(4)]
    path = tmp_path / "images.parquet"
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, path, compression="none", use_dictionary=False, row_group_size=1)
    del rows, table
    before = peak = pa.total_allocated_bytes()
    read = 0
    for row in read_local(path):
        peak = max(peak, pa.total_allocated_bytes())
        read += row.record["image"]["bytes"] == bytes([read]) * (5 * mib)
    assert read == 4
    assert peak - before < 12 * mib  # one row and its page; a batch of four held 26 MiB
