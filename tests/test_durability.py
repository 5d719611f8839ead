"""A full disk keeps the last good version; two runs of one partition never mix.

Disk full is tested twice: on a real 2 MiB tmpfs (needs root to mount), and with the
writers' own write calls patched to fail with ENOSPC once a byte budget is spent (always
runs). Concurrency is tested with real processes: two writers rewrite one (table,
partition) with different contents while this process reads it back through
`TableStore` and through the DuckDB catalog.
"""

from __future__ import annotations

import base64
import builtins
import errno
import io
import multiprocessing
import os
import re
import subprocess
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mm_assets.common import files
from mm_assets.common.files import DiskFullError, atomic_write_text
from mm_assets.common.hashing import file_sha256
from mm_assets.storage import TableStore, open_tables
from mm_assets.storage.blobs import BlobStore

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
TMPFS_BYTES = 2 << 20
INJECTED_BUDGET = 64 << 10  # bytes the injected disk takes before ENOSPC


# -- disk full -------------------------------------------------------------------------


class _FillingFile(io.RawIOBase):
    """A file whose writes fail with ENOSPC once the disk's budget is spent (the bytes
    that still fit are written first, as a real disk does)."""

    def __init__(self, path: Path | str, disk: _InjectedDisk) -> None:
        self._raw = builtins.open(path, "wb")  # noqa: SIM115 (closed in close())
        self._disk = disk

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        if len(view) > self._disk.left:
            self._raw.write(view[: self._disk.left])
            self._disk.left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.left -= len(view)
        return self._raw.write(view)

    def tell(self) -> int:
        return self._raw.tell()

    def close(self) -> None:
        self._raw.close()
        super().close()


class _InjectedDisk:
    def __init__(self, budget: int) -> None:
        self.left = budget


class Disk:
    """Where to write, and `full()`: a block inside which the disk has no room for a
    large write (a 2 MiB tmpfs always; patched writers in the injected variant)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch | None) -> None:
        self.root = root
        self._monkeypatch = monkeypatch

    @property
    def real(self) -> bool:
        return self._monkeypatch is None

    def full(self):
        return nullcontext() if self.real else self._injected()

    @contextmanager
    def _injected(self) -> Iterator[None]:
        import safetensors.torch

        assert self._monkeypatch is not None
        disk = _InjectedDisk(INJECTED_BUDGET)
        real_writer, real_save = pq.ParquetWriter, safetensors.torch.save_file

        class FillingParquetWriter(real_writer):  # type: ignore[misc, valid-type]
            def __init__(self, where, schema, **kwargs) -> None:
                self._sink = _FillingFile(where, disk)
                super().__init__(self._sink, schema, **kwargs)

            def close(self) -> None:
                try:
                    super().close()
                finally:
                    self._sink.close()

        def filling_open(path, mode="r", *args, **kwargs):
            if "w" in mode and "b" in mode:
                return _FillingFile(path, disk)
            return builtins.open(path, mode, *args, **kwargs)

        def filling_save_file(tensors, filename, metadata=None) -> None:
            """As safetensors fails: its OS error flattened into a SafetensorError."""
            from safetensors import SafetensorError

            data = safetensors.torch.save(tensors, metadata)
            with _FillingFile(filename, disk) as out:
                try:
                    out.write(data)
                except OSError as exc:
                    message = f"Error while serializing: I/O error: {exc.strerror} (os error 28)"
                    raise SafetensorError(message) from None

        with self._monkeypatch.context() as patch:
            patch.setattr(pq, "ParquetWriter", FillingParquetWriter)
            patch.setattr(files, "open", filling_open, raising=False)  # atomic_write_text
            patch.setattr(safetensors.torch, "save_file", filling_save_file)
            yield
        assert real_save is safetensors.torch.save_file


@pytest.fixture(params=["tmpfs", "injected"])
def disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Disk]:
    if request.param == "injected":
        yield Disk(tmp_path / "disk", request.getfixturevalue("monkeypatch"))
        return
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the injected variant covers the logic)")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield Disk(mount, None)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _incompressible_text(nbytes: int) -> str:
    return base64.b64encode(os.urandom(nbytes)).decode()


def _big_rows() -> list[dict]:
    return [{"id": i, "name": _incompressible_text(64 << 10)} for i in range(64)]  # ~5 MiB


def _temporary_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if p.name.endswith((".tmp", ".old"))]


def _assert_says_disk_full(error: DiskFullError, final: Path) -> None:
    message = str(error)
    assert error.errno == errno.ENOSPC and isinstance(error, OSError)
    assert str(final) in message
    assert re.search(r"\d+(\.\d)? (B|KiB|MiB|GiB|TiB) was free", message), message
    assert re.search(r"needs (~|more than)", message), message
    assert "MM_ASSETS_HOME" in message and "Free space" in message


def test_table_write_on_a_full_disk_keeps_the_previous_version_and_catalog(disk: Disk) -> None:
    store = TableStore(disk.root)
    first = store.write("things", "p", [{"id": 1, "name": "old"}], SCHEMA)
    with store.connect() as con:
        sql_before = con.execute("SELECT * FROM things").fetchall()
    catalog_before = store.catalog_path.read_bytes()

    with disk.full(), pytest.raises(DiskFullError) as caught:
        store.write("things", "p", _big_rows(), SCHEMA)

    _assert_says_disk_full(caught.value, first.path)
    assert "the previous version is intact" in str(caught.value)
    assert store.read("things", "p").to_pylist() == [{"id": 1, "name": "old"}]
    assert file_sha256(first.path) == first.content_hash
    assert store.catalog_path.read_bytes() == catalog_before
    with store.connect() as con:
        assert con.execute("SELECT * FROM things").fetchall() == sql_before == [(1, "old", "p")]
    assert _temporary_files(disk.root) == []
    # the space the failed write took is free again
    store.write("things", "p", [{"id": 2, "name": "new"}], SCHEMA)
    assert store.read("things", "p").to_pylist() == [{"id": 2, "name": "new"}]


def test_blob_put_on_a_full_disk_leaves_no_blob_and_keeps_the_old_one(
    disk: Disk, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    responses = BlobStore(disk.root, kind="target_responses", suffix=".json")
    responses.put_json({"text": "old"}, "aa01")
    hidden = BlobStore(disk.root)

    with disk.full():
        with pytest.raises(DiskFullError) as caught:
            responses.put_json({"text": _incompressible_text(3 << 20)}, "aa01")
        _assert_says_disk_full(caught.value, responses.path("aa01"))
        with pytest.raises(DiskFullError) as caught:
            responses.put_json({"text": _incompressible_text(3 << 20)}, "bb02")
        _assert_says_disk_full(caught.value, responses.path("bb02"))
        assert "nothing was left there" in str(caught.value)
        with pytest.raises(DiskFullError) as caught:
            hidden.put_tensors({"hidden_states": torch.zeros(1 << 20)}, "cc03")
        _assert_says_disk_full(caught.value, hidden.path("cc03"))
        assert "needs ~4.0 MiB" in str(caught.value)

    assert responses.get_json("aa01") == {"text": "old"}
    assert not responses.has("bb02") and not hidden.has("cc03")
    assert _temporary_files(disk.root) == []

    if disk.real:  # a file from another filesystem is copied in: that copy fills the disk
        source = tmp_path / "from_the_server.safetensors"
        source.write_bytes(os.urandom(3 << 20))
        with pytest.raises(DiskFullError) as caught:
            hidden.put_file(source, "dd04")
        _assert_says_disk_full(caught.value, hidden.path("dd04"))
        assert "needs ~3.0 MiB" in str(caught.value)
        assert not hidden.has("dd04") and source.exists()
        assert _temporary_files(disk.root) == []


def test_atomic_write_text_on_a_full_disk_keeps_the_previous_text(disk: Disk) -> None:
    path = disk.root / "records" / "train.json"
    atomic_write_text(path, "old")
    big = _incompressible_text(3 << 20)
    with disk.full(), pytest.raises(DiskFullError) as caught:
        atomic_write_text(path, big)
    _assert_says_disk_full(caught.value, path)
    assert f"needs ~{len(big) / (1 << 20):.1f} MiB" in str(caught.value)
    assert path.read_text() == "old"
    assert _temporary_files(disk.root) == []


def test_a_failure_that_is_not_a_full_disk_is_left_as_it_is(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not a disk"), files.atomic_path(tmp_path / "f"):
        raise RuntimeError("not a disk problem")
    assert list(tmp_path.iterdir()) == []


def test_move_into_place_flushes_the_servers_file_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server that wrote the file never fsyncs it; the rename must not be durable
    before the data it names (else a power loss leaves a short blob reused as whole)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = files.fsync_path, os.replace

    def fsync(path: Path) -> None:
        events.append(("fsync", Path(path).name))
        real_fsync(path)

    def replace(source: Path, final: Path) -> None:
        events.append(("rename", Path(final).name))
        real_replace(source, final)

    monkeypatch.setattr(files, "fsync_path", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    source = tmp_path / "incoming" / "req-1.safetensors"
    source.parent.mkdir()
    source.write_bytes(b"hidden states")
    blobs = BlobStore(tmp_path)
    final = blobs.put_file(source, "abcd")
    renamed = events.index(("rename", final.name))
    moved = [name for kind, name in events[:renamed] if kind == "fsync"]
    assert any(name.startswith(f".{final.name}.") for name in moved)  # its temporary
    assert events[renamed + 1] == ("fsync", final.parent.name)
    assert final.read_bytes() == b"hidden states" and not source.exists()


def test_a_move_is_checked_on_its_own_file_when_another_writer_stores_the_same_key(
    tmp_path: Path,
) -> None:
    """Two ranks fetching the same held-out row store one key at once: the check of a
    move must see that move's file, not the other writer's, which took the key meanwhile
    (it used to see the other's, refuse its row as replaced and delete the other's blob)."""
    blobs = BlobStore(tmp_path / "store")
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    ours.write_bytes(b"ours")
    theirs.write_bytes(b"theirs")
    inode = ours.stat().st_ino
    seen: list[int] = []

    def verify(moved: Path) -> None:
        blobs.put_file(theirs, "k1")  # the other writer lands first
        seen.append(os.lstat(moved).st_ino)

    final = blobs.put_file(ours, "k1", verify)
    assert seen == [inode] and final.read_bytes() == b"ours"  # both whole; the last wins

    swapped = tmp_path / "swapped.safetensors"
    swapped.write_bytes(b"swapped")

    def refuse(moved: Path) -> None:
        raise ValueError(f"{moved} is not the file that was checked")

    with pytest.raises(ValueError, match="not the file"):
        blobs.put_file(swapped, "k2", refuse)
    assert not blobs.has("k2") and _temporary_files(blobs.dir) == []


# -- temporaries of dead writers -------------------------------------------------------


def test_a_sweep_removes_only_what_dead_writers_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pid means something only on the machine that wrote the name: on a root that
    several machines share, another one's temporary is left alone until it is old."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = "data.parquet"
    ours = f".{name}.{os.getpid()}@{files._host_tag()}-{'a' * 32}.tmp"
    ours_dead = f".{name}.{dead.pid}@{files._host_tag()}-{'b' * 32}.tmp"
    legacy_dead = f".{name}.{dead.pid}-{'c' * 32}.tmp"  # before names carried the host
    foreign = f".{name}.{dead.pid}@0badc0de-{'d' * 32}.tmp"
    foreign_old = f".{name}.{os.getpid()}@0badc0de-{'e' * 32}.old"
    for entry in (ours, ours_dead, legacy_dead, foreign, foreign_old, name):
        (tmp_path / entry).write_text("x")
    old = time.time() - files.FOREIGN_STALE_S - 60
    os.utime(tmp_path / foreign_old, (old, old))
    assert files.remove_stale_temporaries(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ours, foreign, name])
    assert files.temporary_name(name).startswith(f".{name}.{os.getpid()}@{files._host_tag()}-")


# -- two runs of one partition at once -------------------------------------------------

TABLE, PARTITION = "normalized_conversations", "shared"
VERSION_SCHEMA = pa.schema(
    [("writer", pa.int64()), ("version", pa.int64()), ("i", pa.int64()), ("text", pa.string())]
)
WRITERS, VERSIONS = (1, 2), 60


def _version_rows(writer: int, version: int) -> list[dict]:
    """Every version differs in row count, text and file size."""
    n = 20 + (writer * 997 + version * 131) % 400
    return [
        {
            "writer": writer,
            "version": version,
            "i": i,
            "text": f"{writer}:{version}:{i}:" + "x" * ((i * 7 + version) % 50),
        }
        for i in range(n)
    ]


def _rewrite_many_times(
    root: str, private: str, writer: int, start, failures, object_store: str | None, versions: int
) -> None:
    """One run: rewrite the shared partition again and again; now and then write a new
    table too (its view is created mid-contention) and query it at once."""
    try:
        store, alone = open_tables(root, object_store), TableStore(private)
        start.wait(timeout=60)
        for version in range(versions):
            rows = _version_rows(writer, version)
            written = store.write(TABLE, PARTITION, rows, VERSION_SCHEMA)
            # the hash is of this run's file, not of whatever the other run renamed there since
            assert written.num_rows == len(rows)
            assert (
                written.content_hash
                == alone.write(TABLE, PARTITION, rows, VERSION_SCHEMA).content_hash
            )
            if version % 6 == 0:
                side = f"side_{writer}_{version}"
                store.write(side, PARTITION, rows, VERSION_SCHEMA)
                with store.connect() as con:
                    assert con.execute(f"SELECT count(*) FROM {side}").fetchone() == (len(rows),)
    except BaseException:
        failures.put(f"writer {writer}: {traceback.format_exc()}")
        raise


def _assert_one_complete_version(rows: list[dict], how: str) -> tuple[int, int]:
    assert rows, f"{how}: no rows"
    writer, version = rows[0]["writer"], rows[0]["version"]
    assert rows == _version_rows(writer, version), f"{how}: not one complete version"
    return writer, version


def _sql_rows(store: TableStore) -> list[dict]:
    with store.connect() as con:
        got = con.execute(
            f"SELECT writer, version, i, text FROM {TABLE} WHERE dataset = ? ORDER BY i",
            [PARTITION],
        ).fetchall()
    return [dict(zip(VERSION_SCHEMA.names, row, strict=True)) for row in got]


@pytest.mark.parametrize("where", ["local", pytest.param("object_store", marks=pytest.mark.slow)])
def test_two_runs_of_one_partition_at_once_never_mix(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """On the root, and on an object store (SeaweedFS) where versions replace renames."""
    url = request.getfixturevalue("object_store_url") if where == "object_store" else None
    versions = VERSIONS if url is None else VERSIONS // 3  # ~0.3 s a write to the S3 server
    store = open_tables(tmp_path / "home", url)
    store.write(TABLE, PARTITION, _version_rows(0, 0), VERSION_SCHEMA)
    context = multiprocessing.get_context("spawn")
    start, failures = context.Barrier(len(WRITERS) + 1), context.Queue()
    runs = [
        context.Process(
            target=_rewrite_many_times,
            args=(str(store.root), str(tmp_path / f"alone{w}"), w, start, failures, url, versions),
        )
        for w in WRITERS
    ]
    for run in runs:
        run.start()
    reads = {"TableStore.read": 0, "TableStore.iter_rows": 0, "catalog SQL": 0}
    seen: set[tuple[int, int]] = set()
    try:
        start.wait(timeout=60)
        began = time.monotonic()
        while any(run.is_alive() for run in runs):
            assert time.monotonic() - began < 60, "the writers did not finish"
            seen.add(_assert_one_complete_version(store.read(TABLE, PARTITION).to_pylist(), "read"))
            seen.add(
                _assert_one_complete_version(
                    list(store.iter_rows(TABLE, PARTITION, batch_size=7)), "iter_rows"
                )
            )
            seen.add(_assert_one_complete_version(_sql_rows(store), "SQL"))
            for how in reads:
                reads[how] += 1
    finally:
        for run in runs:
            run.join(timeout=30)
            if run.is_alive():
                run.kill()
    messages = []
    while not failures.empty():
        messages.append(failures.get())
    assert not messages, "\n".join(messages)
    assert [run.exitcode for run in runs] == [0, 0]
    assert min(reads.values()) >= 5 and len({w for w, _ in seen}) >= 2, (reads, seen)
    final = _assert_one_complete_version(store.read(TABLE, PARTITION).to_pylist(), "read")
    assert final[1] == versions - 1
    assert _assert_one_complete_version(_sql_rows(store), "SQL") == final
    assert _temporary_files(store.root) == []


class _Payload:
    """What a crafted training-state file would run when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_crafted_training_state_runs_nothing_and_is_ignored(tmp_path: Path) -> None:
    import pickle

    import torch

    from mm_assets.storage.checkpoints import TrainStateFile

    marker = tmp_path / "pwned"
    state = tmp_path / "train_state.pt"
    state.write_bytes(pickle.dumps({"epoch": 1, "model": _Payload(marker)}))
    assert TrainStateFile(state).load(torch.device("cpu")) is None
    assert not marker.exists()


def test_a_training_state_cut_short_is_an_error_naming_the_fix(tmp_path: Path) -> None:
    """A state `torch.save` wrote, cut where a copy or a full disk could stop it: wherever
    the cut falls (torch raises EOFError, RuntimeError or OSError), the error names the
    file and what to do; a whole one still loads."""
    import torch

    from mm_assets.storage.checkpoints import TrainStateFile

    state = TrainStateFile(tmp_path / "train_state.pt")
    state.save({"epoch": 2, "model": {"w": torch.randn(64, 64)}, "epoch_losses": [1.0, 0.5]})
    whole = state.path.read_bytes()
    assert state.load(torch.device("cpu"))["epoch"] == 2
    for cut in (0, 5, 100, len(whole) // 2, len(whole) - 10):
        state.path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=r"cut short or damaged\. Delete it") as caught:
            state.load(torch.device("cpu"))
        assert str(state.path) in str(caught.value) and "retrain: true" in str(caught.value)
