"""Parquet writes are atomic and every table is queryable through DuckDB."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from mm_assets.storage import TableStore
from mm_assets.storage.layout import StorageLayout

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])


def test_write_then_read_and_query(tmp_path: Path) -> None:
    store = TableStore(tmp_path)
    store.write("things", "p1", [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}], SCHEMA)
    store.write("things", "p2", [{"id": 3, "name": "c"}], SCHEMA)
    assert [r["name"] for r in store.iter_rows("things", "p1")] == ["a", "b"]
    with store.connect() as con:
        rows = con.execute(
            "SELECT dataset, count(*) FROM things GROUP BY ALL ORDER BY 1"
        ).fetchall()
    assert rows == [("p1", 2), ("p2", 1)]


def test_failed_write_keeps_the_previous_version_and_leaves_no_temp(tmp_path: Path) -> None:
    store = TableStore(tmp_path)
    first = store.write("things", "p", [{"id": 1, "name": "old"}], SCHEMA)
    with pytest.raises(RuntimeError), store.writer("things", "p", SCHEMA, batch_size=1) as out:
        out.write({"id": 2, "name": "new"})
        raise RuntimeError("crash mid-write")
    assert [r["name"] for r in store.iter_rows("things", "p")] == ["old"]
    assert sorted(p.name for p in first.path.parent.iterdir()) == [".snapshots", "data.parquet"]
    assert [p.name for p in (first.path.parent / ".snapshots").iterdir()] == [f"{0:020d}.parquet"]


def test_content_hash_tracks_content(tmp_path: Path) -> None:
    store = TableStore(tmp_path)
    a = store.write("t", "p", [{"id": 1, "name": "x"}], SCHEMA).content_hash
    b = store.write("t", "p", [{"id": 1, "name": "x"}], SCHEMA).content_hash
    c = store.write("t", "p", [{"id": 1, "name": "y"}], SCHEMA).content_hash
    assert a == b != c


def test_reading_a_missing_partition_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="materialize"):
        TableStore(tmp_path).read("things", "nope")


def test_reading_a_column_an_older_version_did_not_write_says_what_to_do(tmp_path: Path) -> None:
    store = TableStore(tmp_path)
    store.write("things", "p", [{"id": 1, "name": "a"}], SCHEMA)
    with pytest.raises(ValueError, match=r"no column \['colour'\].*rematerialize things"):
        next(store.iter_rows("things", "p", ["id", "colour"]))


def test_a_written_table_is_in_the_catalog_at_once(tmp_path: Path) -> None:
    """The view is created by the write itself (storage layer), so the catalog path a
    user reads in the UI answers without anything else touching it; a new partition of
    the table needs no new view (views read every partition's file)."""
    import duckdb

    store = TableStore(tmp_path)
    store.write("things", "p1", [{"id": 1, "name": "a"}], SCHEMA)
    with duckdb.connect(str(store.catalog_path), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM things").fetchone() == (1,)
    store.write("things", "p2", [{"id": 2, "name": "b"}], SCHEMA)
    with duckdb.connect(str(store.catalog_path), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM things").fetchone() == (2,)


def test_a_name_that_would_leave_its_directory_never_becomes_a_path(tmp_path: Path) -> None:
    """Whatever a caller passes: the registry refuses such names, this holds without it."""
    layout = StorageLayout(tmp_path)
    for name in ("../../x", "a/b", "..", "/etc", ""):
        for where in (layout.draft, layout.untrained_draft, layout.train_state):
            with pytest.raises(ValueError, match="not a plain name"):
                where(name)
    assert layout.draft("a..b.c") == tmp_path / "speculators" / "a..b.c"
    with pytest.raises(ValueError, match="not a plain name"):
        TableStore(tmp_path).write("t", "x/../../../y", [{"id": 1, "name": "a"}], SCHEMA)
    assert not (tmp_path.parent / "y").exists()
