"""The tables on an object store: every worker of a cluster reads the same ones.

An object store has no rename and no hard link, so a table version is an object never
changed, named `<table>/dataset=<partition>/<time_ns>-<sha256>.parquet`, and the newest
name is the current version. A write stages the file locally and uploads it whole (an
upload appears complete or not at all), so a killed writer leaves nothing; a reader
reads the version it opened to the end; the catalog's views read the objects by glob,
newest per partition. A version superseded more than `SNAPSHOT_GRACE_S` ago is deleted
by the next write of its partition; rewriting the bytes a partition holds uploads nothing.

The DuckDB catalog stays under the local root; `connect()` hands DuckDB the fsspec
filesystem that wrote the objects (another session needs httpfs and a secret).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from mm_assets.common.files import make_dirs, remove_stale_temporaries, temporary_name
from mm_assets.common.hashing import file_sha256
from mm_assets.storage.object_store import ObjectStore
from mm_assets.storage.tables import (
    CATALOG_WAIT_S,
    PARTITION_COLUMN,
    SNAPSHOT_GRACE_S,
    WRITE_CATALOG_WAIT_S,
    BatchWriter,
    TableStore,
    WrittenTable,
    missing_table,
    parquet_rows,
)

VERSION = re.compile(r"^(\d{20})-([0-9a-f]{64})\.parquet$")


class ObjectTableStore(TableStore):
    """Tables under `<store>/tables/`; catalog, staging files and blobs under `root`."""

    def __init__(self, root: Path | str, store: ObjectStore) -> None:
        super().__init__(root)
        self.store = store
        self.grace_s = SNAPSHOT_GRACE_S

    @property
    def location(self) -> str:
        return self.store.url_of("tables")

    def connect_code(self) -> str:
        return f"mm_assets.storage.open_tables('{self.root}', '{self.store.url}').connect()"

    def path(self, table: str, partition: str) -> str:
        """The URL of the partition's current version (of its folder, when it has none)."""
        versions = self._versions(table, partition)
        key = versions[-1] if versions else self._partition_key(table, partition)
        return f"{self.store.scheme}://{key}"

    def exists(self, table: str, partition: str) -> bool:
        return bool(self._versions(table, partition))

    def content_hash(self, table: str, partition: str) -> str:
        return _parse_version(self._current(table, partition))[1]

    @contextmanager
    def writer(
        self, table: str, partition: str, schema: pa.Schema, batch_size: int = 1024
    ) -> Iterator[BatchWriter]:
        """Stream rows into a staged file; on success it is uploaded as the new version."""
        staging = self.root / "staging"
        make_dirs(staging)
        remove_stale_temporaries(staging)  # what killed writers left
        tmp = staging / temporary_name(f"{table}.{partition}.parquet")
        try:
            with parquet_rows(tmp, schema, batch_size) as batch_writer:
                yield batch_writer
            content_hash = file_sha256(tmp)
            key = self._upload(tmp, table, partition, content_hash)
        finally:
            tmp.unlink(missing_ok=True)
        url = f"{self.store.scheme}://{key}"
        batch_writer.result = WrittenTable(url, batch_writer.num_rows, content_hash)
        self._prune(table, partition)
        self.add_to_catalog([table], WRITE_CATALOG_WAIT_S)

    def _upload(self, staged: Path, table: str, partition: str, content_hash: str) -> str:
        """The new current version's key (the newest already, if it holds these bytes)."""
        versions = self._versions(table, partition)
        if versions and versions[-1].endswith(f"-{content_hash}.parquet"):
            return versions[-1]
        name = f"{time.time_ns():020d}-{content_hash}.parquet"
        key = f"{self._partition_key(table, partition)}/{name}"
        self.store.fs.put_file(str(staged), key)
        return key

    def _prune(self, table: str, partition: str) -> None:
        """Delete the versions superseded (by the next one's name) over `grace_s` ago."""
        now = time.time_ns()
        for older, newer in itertools.pairwise(self._versions(table, partition)):
            if now - _parse_version(newer)[0] > self.grace_s * 1e9:
                with contextlib.suppress(FileNotFoundError):  # pruned by another writer
                    self.store.fs.rm_file(older)

    @contextmanager
    def _open(self, table: str, partition: str) -> Iterator[pq.ParquetFile]:
        with (
            self.store.fs.open(self._current(table, partition), "rb") as handle,
            pq.ParquetFile(handle) as parquet,
        ):
            yield parquet

    def _current(self, table: str, partition: str) -> str:
        versions = self._versions(table, partition)
        if not versions:
            raise missing_table(table, partition, self.path(table, partition))
        return versions[-1]

    def _versions(self, table: str, partition: str) -> list[str]:
        """The partition's versions, oldest first."""
        try:
            keys = self.store.fs.ls(self._partition_key(table, partition), detail=False)
        except FileNotFoundError:
            return []
        return sorted(k for k in keys if VERSION.match(k.rsplit("/", 1)[-1]))

    def _partition_key(self, table: str, partition: str) -> str:
        return self.store.key("tables", table, f"{PARTITION_COLUMN}={partition}")

    # -- DuckDB catalog -------------------------------------------------------------

    def table_names(self) -> list[str]:
        keys = self.store.fs.glob(self.store.key("tables", "*", "*", "*.parquet"))
        return sorted({k.split("/")[-3] for k in keys if VERSION.match(k.rsplit("/", 1)[-1])})

    def add_to_catalog(self, tables: Sequence[str], wait_s: float = CATALOG_WAIT_S) -> None:
        """Versions are never rewritten, so views read them directly: no snapshots."""
        self._ensure_views(tables, wait_s)

    def _view_glob(self, table: str) -> str:
        return self.store.url_of("tables", table, "*", "*.parquet")

    def _prepare(self, con: duckdb.DuckDBPyConnection) -> None:
        con.register_filesystem(self.store.fs)


def _parse_version(key: str) -> tuple[int, str]:
    """A version's write time (ns) and SHA-256."""
    match = VERSION.match(key.rsplit("/", 1)[-1])
    assert match is not None
    return int(match.group(1)), match.group(2)
