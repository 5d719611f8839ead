"""Tables and checkpoints on an object store, against a real S3-compatible server
(SeaweedFS, `tests/s3_server.py`): versions that appear whole or not at all, readers that
keep the version they opened, the DuckDB catalog over the store's URLs, checkpoints
published so a reader never sees one training's weights with another's config, and the
prep stages of the real definitions writing there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from mm_assets.storage import ObjectStore, TableStore, open_tables
from mm_assets.storage.object_store import PUBLISHED, publish_directory
from mm_assets.storage.object_tables import ObjectTableStore
from tests.conftest import materialize

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])


def _rows(n: int, tag: str = "a") -> list[dict]:
    return [{"id": i, "name": f"{tag}{i}"} for i in range(n)]


def _versions(store: ObjectTableStore, table: str, partition: str) -> list[str]:
    return store._versions(table, partition)


# -- no server needed ---------------------------------------------------------------------


@pytest.mark.parametrize("url", ["/data/tables", "file:///data", "s3://", "ftp://host/x"])
def test_a_url_that_is_not_an_atomic_object_store_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="MM_ASSETS_OBJECT_STORE") as caught:
        ObjectStore(url)
    assert "s3, s3a, gs" in str(caught.value)


def test_a_store_url_with_a_password_is_refused_without_showing_it() -> None:
    """The store's credentials come from its own configuration; the URL is shown."""
    for url in ("s3://key:pw-s3cret@bucket/prefix", "ftp://u:pw-s3cret@host/x"):
        with pytest.raises(ValueError, match="MM_ASSETS_OBJECT_STORE") as caught:
            ObjectStore(url)
        assert "pw-s3cret" not in str(caught.value) and ":***@" in str(caught.value)


def test_without_an_object_store_the_tables_stay_under_the_root(tmp_path: Path) -> None:
    assert type(open_tables(tmp_path)) is TableStore
    assert type(open_tables(tmp_path, "")) is TableStore
    assert isinstance(open_tables(tmp_path, "s3://bucket/prefix"), ObjectTableStore)


# -- tables -------------------------------------------------------------------------------


@pytest.mark.slow
def test_tables_round_trip_and_each_write_is_a_new_version(
    object_store_url: str, tmp_path: Path
) -> None:
    store = open_tables(tmp_path, object_store_url)
    assert isinstance(store, ObjectTableStore)
    assert not store.exists("t", "p")
    with pytest.raises(FileNotFoundError, match="materialize the asset"):
        store.read("t", "p")

    first = store.write("t", "p", _rows(5), SCHEMA)
    assert str(first.path).startswith(object_store_url + "/tables/t/dataset=p/")
    assert store.read("t", "p").to_pylist() == _rows(5)
    assert list(store.iter_rows("t", "p", batch_size=2)) == _rows(5)
    assert store.num_rows("t", "p") == 5 and store.exists("t", "p")
    # the same bytes as the local store writes: data versions agree across the two
    local = TableStore(tmp_path / "local").write("t", "p", _rows(5), SCHEMA)
    assert first.content_hash == local.content_hash == store.content_hash("t", "p")
    assert not list((tmp_path / "staging").iterdir())

    again = store.write("t", "p", _rows(5), SCHEMA)  # a cached rerun: nothing uploaded
    assert again.path == first.path and len(_versions(store, "t", "p")) == 1

    store.write("t", "p", _rows(3, "b"), SCHEMA)
    assert store.read("t", "p").to_pylist() == _rows(3, "b")
    assert len(_versions(store, "t", "p")) == 2  # the old one waits out the grace period
    store.grace_s = 0.0
    store.write("t", "p", _rows(4, "c"), SCHEMA)
    assert len(_versions(store, "t", "p")) == 1
    assert store.read("t", "p").to_pylist() == _rows(4, "c")


@pytest.mark.slow
def test_a_reader_keeps_the_version_it_opened(object_store_url: str, tmp_path: Path) -> None:
    store = open_tables(tmp_path, object_store_url)
    store.write("t", "p", _rows(3000), SCHEMA)
    reading = store.iter_rows("t", "p", batch_size=100)
    first = [next(reading) for _ in range(150)]
    store.write("t", "p", _rows(10, "new"), SCHEMA)
    store.write("t", "p", _rows(20, "newer"), SCHEMA)
    assert first + list(reading) == _rows(3000)
    assert store.read("t", "p").to_pylist() == _rows(20, "newer")


@pytest.mark.slow
def test_a_failed_or_killed_writer_leaves_the_previous_version(
    object_store_url: str, tmp_path: Path
) -> None:
    store = open_tables(tmp_path, object_store_url)
    store.write("t", "p", _rows(5), SCHEMA)
    with pytest.raises(RuntimeError, match="bad row"), store.writer("t", "p", SCHEMA) as out:
        out.write_many(_rows(3, "partial"))
        raise RuntimeError("bad row")
    assert store.read("t", "p").to_pylist() == _rows(5)
    assert not list((tmp_path / "staging").iterdir())

    # a process killed after its first batch went to the staged file
    script = textwrap.dedent(
        f"""
        import pyarrow as pa
        from mm_assets.storage import open_tables
        store = open_tables({str(tmp_path)!r}, {object_store_url!r})
        schema = pa.schema([("id", pa.int64()), ("name", pa.string())])
        with store.writer("t", "p", schema, batch_size=2) as out:
            out.write_many({{"id": i, "name": "killed"}} for i in range(10))
        """
    )
    env = {**os.environ, "MM_ASSETS_CRASH_AT": "table_write:1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert len(list((tmp_path / "staging").iterdir())) == 1  # its staged file, not uploaded
    assert store.read("t", "p").to_pylist() == _rows(5)
    assert len(_versions(store, "t", "p")) == 1
    store.write("u", "p", _rows(1), SCHEMA)  # the next write sweeps what the dead one left
    assert not list((tmp_path / "staging").iterdir())


@pytest.mark.slow
def test_the_catalog_reads_the_newest_version_of_every_partition(
    object_store_url: str, tmp_path: Path
) -> None:
    store = open_tables(tmp_path, object_store_url)
    store.write("t", "p1", _rows(3), SCHEMA)
    store.write("t", "p2", _rows(2, "x"), SCHEMA)
    store.write("t", "p1", _rows(4, "y"), SCHEMA)
    store.write("other", "p1", _rows(1), SCHEMA)
    assert store.table_names() == ["other", "t"]
    with store.connect() as con:
        got = con.execute("SELECT dataset, id, name FROM t ORDER BY dataset, id").fetchall()
        views = dict(con.execute("SELECT view_name, sql FROM duckdb_views()").fetchall())
    assert got == [("p1", r["id"], r["name"]) for r in _rows(4, "y")] + [
        ("p2", r["id"], r["name"]) for r in _rows(2, "x")
    ]
    assert object_store_url + "/tables/t/" in views["t"]
    # a new store object (another process) sees the same, and so would a new partition
    with open_tables(tmp_path, object_store_url).connect() as con:
        assert con.execute("SELECT count(*) FROM t").fetchone() == (6,)


# -- checkpoints --------------------------------------------------------------------------


def _checkpoint(directory: Path, config: str, weights: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(config)
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "mm_assets_outcome.json").write_text('{"key": 1}')
    return directory


@pytest.mark.slow
def test_a_published_checkpoint_is_never_one_trainings_weights_with_anothers_config(
    object_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ObjectStore(object_store_url)
    local = _checkpoint(tmp_path / "draft", '{"v": 1}', b"weights-1")
    url, uploaded = publish_directory(store, local, "speculators", "p")
    assert url == object_store_url + "/speculators/p" and uploaded == 3
    remote = store.key("speculators", "p")
    assert store.fs.cat_file(f"{remote}/model.safetensors") == b"weights-1"
    assert publish_directory(store, local, "speculators", "p") == (url, 0)

    # a new training: the upload dies after the weights; no config is left beside them
    _checkpoint(local, '{"v": 2}', b"weights-2")
    (local / "mm_assets_outcome.json").unlink()
    real_put = store.fs.put_file
    calls: list[str] = []

    def dying_put(lpath, rpath, *args, **kwargs):
        calls.append(Path(rpath).name)
        if len(calls) > 1:
            raise ConnectionError("network gone")
        return real_put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(store.fs, "put_file", dying_put)
    with pytest.raises(ConnectionError):
        publish_directory(store, local, "speculators", "p")
    monkeypatch.undo()
    names = {Path(k).name for k in store.fs.ls(remote, detail=False)}
    assert calls == ["model.safetensors", "config.json"]
    assert "config.json" not in names and PUBLISHED not in names
    # the next publish completes it and removes what the directory no longer holds
    assert publish_directory(store, local, "speculators", "p")[1] == 2  # unvouched: both
    names = {Path(k).name for k in store.fs.ls(remote, detail=False)}
    assert names == {"config.json", "model.safetensors", PUBLISHED}
    assert store.fs.cat_file(f"{remote}/config.json") == b'{"v": 2}'


# -- the real definitions -----------------------------------------------------------------


@pytest.mark.slow
def test_the_prep_stages_write_to_the_object_store_as_they_write_locally(
    object_store_url: str, prepared_demo: dict, tmp_path: Path
) -> None:
    from mm_assets.assets.resources import StorageResource
    from tests.conftest import PREP_ASSETS, SESSION_HOME

    resource = StorageResource(root=str(tmp_path / "root"), object_store=object_store_url)
    result = materialize("demo_sharegpt", PREP_ASSETS, {"storage": resource})
    assert result.success
    remote, local = resource.tables(), TableStore(SESSION_HOME)
    assert isinstance(remote, ObjectTableStore)
    for table in ("raw_dataset", "normalized_conversations", "tokenized_samples"):
        assert remote.read(table, "demo_sharegpt").equals(local.read(table, "demo_sharegpt"))
        assert remote.content_hash(table, "demo_sharegpt") == local.content_hash(
            table, "demo_sharegpt"
        )
    assert not (tmp_path / "root" / "tables").exists()
    events = result.get_asset_materialization_events()
    paths = [e.materialization.metadata["path"].value for e in events]
    assert paths and all(str(p).startswith(object_store_url) for p in paths)
