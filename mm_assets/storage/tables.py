"""Parquet tables, one file per (table, partition), with a DuckDB catalog of views.

Writes go to a temporary name and are renamed into place, so a crash never leaves a
half-written file that looks valid, and two runs writing the same partition leave one
run's complete version. Readers open the file once and keep the version they opened.

DuckDB opens a file by its path again while it scans, so a view over a path that a
rename replaces can read the footer of one version and the pages of the next. The views
therefore read snapshots: each version is also hard-linked under a new, never reused
name in the partition's `.snapshots/`, and a view keeps the newest per partition. A
superseded snapshot is deleted `SNAPSHOT_GRACE_S` after the next one appeared, so a
query that listed it can still open it.

DuckDB lets one process write a database or many read it, so the catalog is off the
write path: a view reads its snapshots by glob (every partition, present and future),
and only a table's first write opens the catalog for writing, waiting `CATALOG_WAIT_S`
at most for another process's lock (the next write or `connect()` makes the view).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from mm_assets.common.crashpoints import crash_point
from mm_assets.common.files import atomic_path
from mm_assets.common.hashing import file_sha256
from mm_assets.storage.layout import child

PARTITION_COLUMN = "dataset"
DATA_FILE = "data.parquet"
SNAPSHOTS_DIR = ".snapshots"
SNAPSHOT_GRACE_S = 60.0
# How long to wait for another process's lock on the catalog (DuckDB fails at once):
# `connect()` waits longer than a write, whose view can as well be made later.
CATALOG_WAIT_S = 10.0
WRITE_CATALOG_WAIT_S = 2.0
# Views this process saw current in a catalog file (path, device, inode, mtime): later
# writes skip opening the catalog (each open contends for its lock).
_CURRENT_VIEWS: set[tuple[str, int, int, int, str]] = set()


@dataclass(frozen=True)
class WrittenTable:
    """What a write produced: a path (or object store URL), rows, the file's SHA-256."""

    path: Path | str
    num_rows: int
    content_hash: str


class BatchWriter:
    """Appends rows (dicts) in batches to a new Parquet file (zstd)."""

    def __init__(self, path: Path, schema: pa.Schema, batch_size: int) -> None:
        self._path = path
        self._schema = schema
        self._batch_size = batch_size
        self._writer = pq.ParquetWriter(path, schema, compression="zstd")
        self._pending: list[Mapping[str, Any]] = []
        self.num_rows = 0
        self.result: WrittenTable | None = None  # set when the block completes

    def write(self, row: Mapping[str, Any]) -> None:
        self._pending.append(row)
        if len(self._pending) >= self._batch_size:
            self.flush()

    def write_many(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for row in rows:
            self.write(row)

    def flush(self) -> None:
        if not self._pending:
            return
        batch = pa.Table.from_pylist(self._pending, schema=self._schema)
        self._writer.write_table(batch)
        crash_point("table_write")
        self.num_rows += len(self._pending)
        self._pending = []

    def discard(self) -> None:
        """Drop every row written so far: the file starts over, empty."""
        self._writer.close()
        self._writer = pq.ParquetWriter(self._path, self._schema, compression="zstd")
        self._pending, self.num_rows = [], 0

    def close(self) -> None:
        self._writer.close()


@contextmanager
def parquet_rows(path: Path, schema: pa.Schema, batch_size: int) -> Iterator[BatchWriter]:
    """A new Parquet file at `path`, fed rows; flushed and closed when the block ends."""
    batch_writer = BatchWriter(path, schema, batch_size)
    try:
        yield batch_writer
        batch_writer.flush()
    finally:
        batch_writer.close()


class TableStore:
    """Parquet files under `<root>/tables/<table>/dataset=<partition>/data.parquet`
    (`ObjectTableStore`: on an object store); the catalog is under the local root."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.tables_dir = self.root / "tables"
        self.catalog_path = self.root / "catalog.duckdb"

    @property
    def location(self) -> str:
        """Where the tables are, for people: a directory or a URL."""
        return str(self.tables_dir)

    def connect_code(self) -> str:
        """Python that opens this catalog for reading, for people to paste."""
        return f"duckdb.connect('{self.catalog_path}', read_only=True)"

    def path(self, table: str, partition: str) -> Path | str:
        return self._local_path(table, partition)

    def resolve(self, stored: str) -> Path:
        """A path a table records, relative to this root (an absolute one is kept)."""
        return self.root / stored

    def exists(self, table: str, partition: str) -> bool:
        return self._local_path(table, partition).is_file()

    def content_hash(self, table: str, partition: str) -> str:
        """SHA-256 of the partition's current file: what a result computed from it keys on."""
        return file_sha256(self._existing(table, partition))

    def _local_path(self, table: str, partition: str) -> Path:
        return child(self.tables_dir / table, f"{PARTITION_COLUMN}={partition}") / DATA_FILE

    @contextmanager
    def writer(
        self, table: str, partition: str, schema: pa.Schema, batch_size: int = 1024
    ) -> Iterator[BatchWriter]:
        """Stream rows into a new version of the table; it replaces the old one on success."""
        final = self._local_path(table, partition)
        with atomic_path(final) as tmp:
            with parquet_rows(tmp, schema, batch_size) as batch_writer:
                yield batch_writer
            content_hash = file_sha256(tmp)  # `final` may already hold another run's version
        batch_writer.result = WrittenTable(final, batch_writer.num_rows, content_hash)
        self.add_to_catalog([table], WRITE_CATALOG_WAIT_S)

    def write(
        self, table: str, partition: str, rows: Iterable[Mapping[str, Any]], schema: pa.Schema
    ) -> WrittenTable:
        with self.writer(table, partition, schema) as out:
            out.write_many(rows)
        assert out.result is not None
        return out.result

    def read(self, table: str, partition: str, columns: Sequence[str] | None = None) -> pa.Table:
        with self._open(table, partition) as parquet:
            return parquet.read(columns=columns)

    def iter_rows(
        self,
        table: str,
        partition: str,
        columns: Sequence[str] | None = None,
        batch_size: int = 1024,
    ) -> Iterator[dict[str, Any]]:
        """Rows as dicts, read batch by batch so memory stays flat in the table's size."""
        with self._open(table, partition) as parquet:
            missing = sorted(set(columns or ()) - set(parquet.schema_arrow.names))
            if missing:
                raise ValueError(
                    f"{table} of partition {partition!r} has no column {missing}: it was "
                    f"written by an earlier version of mm_assets; rematerialize {table}"
                )
            for batch in parquet.iter_batches(batch_size=batch_size, columns=columns):
                yield from batch.to_pylist()

    def num_rows(self, table: str, partition: str) -> int:
        with self._open(table, partition) as parquet:
            return parquet.metadata.num_rows

    @contextmanager
    def _open(self, table: str, partition: str) -> Iterator[pq.ParquetFile]:
        """The partition's current version, opened once: `pq.read_table(path)` opens the
        path more than once, and a concurrent rewrite between the opens tears the read."""
        with pq.ParquetFile(self._existing(table, partition)) as parquet:
            yield parquet

    def _existing(self, table: str, partition: str) -> Path:
        path = self._local_path(table, partition)
        if not path.is_file():
            raise missing_table(table, partition, path)
        return path

    # -- DuckDB catalog -------------------------------------------------------------

    def table_names(self) -> list[str]:
        if not self.tables_dir.is_dir():
            return []
        return sorted(
            d.name for d in self.tables_dir.iterdir() if d.is_dir() and any(d.glob("*/*.parquet"))
        )

    def _view_glob(self, table: str) -> str:
        """The files a view reads, newest per partition: the snapshots."""
        return (self.tables_dir / table / "*" / SNAPSHOTS_DIR / "*.parquet").as_posix()

    def _snapshot_glob(self, table: str) -> str:
        """The view's file pattern as a SQL string literal."""
        return "'" + self._view_glob(table).replace("'", "''") + "'"

    def _view_sql(self, table: str) -> str:
        """The newest snapshot per partition, picked inside one scan (a `max() OVER` is
        planned as a self-join of two scans, whose listings can disagree)."""
        return (
            f'CREATE OR REPLACE VIEW "{table}" AS SELECT * EXCLUDE (_snapshot) FROM '
            f"read_parquet({self._snapshot_glob(table)}, hive_partitioning = true, "
            "union_by_name = true, filename = '_snapshot') QUALIFY dense_rank() OVER "
            f"(PARTITION BY {PARTITION_COLUMN} ORDER BY _snapshot DESC) = 1"
        )

    def add_to_catalog(self, tables: Sequence[str], wait_s: float = CATALOG_WAIT_S) -> None:
        """Snapshot each partition's current file and create the views these tables lack
        (the catalog is opened for writing only then); what fails (a catalog busy past
        `wait_s`, a full disk) is left to a later write or `connect()`."""
        for table in tables:
            for partition_dir in sorted((self.tables_dir / table).glob(f"*/{DATA_FILE}")):
                _publish_snapshot(partition_dir.parent)
        self._ensure_views(tables, wait_s)

    def _ensure_views(self, tables: Sequence[str], wait_s: float) -> None:
        known = self._catalog_identity()
        if known and all((*known, self._view_glob(t)) in _CURRENT_VIEWS for t in tables):
            return
        try:
            if self.catalog_path.exists():
                with self._open_catalog(read_only=True, wait_s=wait_s) as con:
                    stale = self._stale_views(con, tables)
            else:
                stale = list(tables)
            if stale:
                with self._open_catalog(read_only=False, wait_s=wait_s) as con:
                    for table in self._stale_views(con, stale):
                        con.execute(self._view_sql(table))
        except (duckdb.IOException, duckdb.ConnectionException):
            return  # the catalog stayed busy
        if known := self._catalog_identity():
            _CURRENT_VIEWS.update((*known, self._view_glob(t)) for t in tables)

    def _catalog_identity(self) -> tuple[str, int, int, int] | None:
        try:
            stat = self.catalog_path.stat()
        except FileNotFoundError:
            return None
        return str(self.catalog_path), stat.st_dev, stat.st_ino, stat.st_mtime_ns

    def _stale_views(self, con: duckdb.DuckDBPyConnection, tables: Sequence[str]) -> list[str]:
        rows = con.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal")
        views = dict(rows.fetchall())
        return [t for t in tables if self._snapshot_glob(t) not in views.get(t, "")]

    def connect(self, wait_s: float = CATALOG_WAIT_S) -> duckdb.DuckDBPyConnection:
        """A read-only SQL connection with every table as a view (`SELECT * FROM <table>`)."""
        self.add_to_catalog(self.table_names(), wait_s)
        if not self.catalog_path.exists():
            raise FileNotFoundError(f"no tables under {self.location} yet")
        try:
            return self._open_catalog(read_only=True, wait_s=wait_s)
        except (duckdb.IOException, duckdb.ConnectionException) as exc:
            if not _is_busy(exc):
                raise
            raise type(exc)(
                f"{exc}\n{self.catalog_path} stayed open for writing in another process for "
                f"{wait_s:.0f} s (mm_assets holds it only to add a view): close the DuckDB "
                "session that opened it read-write, or open it with read_only=True"
            ) from exc

    def _open_catalog(self, read_only: bool, wait_s: float) -> duckdb.DuckDBPyConnection:
        """Connect, retrying while the file is held (`_is_busy`): DuckDB does not wait."""
        deadline = time.monotonic() + wait_s
        delay = 0.01
        while True:
            try:
                con = duckdb.connect(str(self.catalog_path), read_only=read_only)
                self._prepare(con)
                return con
            except (duckdb.IOException, duckdb.ConnectionException) as exc:
                if not _is_busy(exc) or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay * random.uniform(0.5, 1.5))  # jitter: writers do not march
            delay = min(delay * 2, 0.2)

    def _prepare(self, con: duckdb.DuckDBPyConnection) -> None:
        """What a connection needs before it can read the views (nothing, on a local disk)."""


def missing_table(table: str, partition: str, where: Path | str) -> FileNotFoundError:
    return FileNotFoundError(
        f"table {table!r} has no data for partition {partition!r} ({where}); "
        f"materialize the asset that writes it for this partition first"
    )


def _publish_snapshot(partition_dir: Path, grace_s: float = SNAPSHOT_GRACE_S) -> None:
    """Hard-link the partition's current file as its newest snapshot, then delete those
    superseded more than `grace_s` ago. Safe in several processes at once (`os.link`
    refuses a taken name); gives up on an OSError (a file pruned meanwhile, no links)."""
    current = partition_dir / DATA_FILE
    snapshots = partition_dir / SNAPSHOTS_DIR
    with contextlib.suppress(OSError):
        snapshots.mkdir(exist_ok=True)
        while True:
            numbered = _snapshots(snapshots)
            if numbered and _same_file(numbered[-1], current):
                break
            number = int(numbered[-1].stem) + 1 if numbered else 0
            try:
                os.link(current, snapshots / f"{number:020d}.parquet")
                break
            except FileExistsError:  # another writer took that number: look again
                continue
        numbered = _snapshots(snapshots)
        now = time.time()
        for older, newer in itertools.pairwise(numbered):
            # ctime: when `newer` was linked, or later (never earlier)
            if now - newer.stat().st_ctime > grace_s:
                older.unlink(missing_ok=True)


def _snapshots(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.parquet") if p.stem.isdigit())


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except FileNotFoundError:
        return False


def _is_busy(exc: duckdb.Error) -> bool:
    """A lock held by another process, or a connection of this one opened the other way
    (read-only vs read-write): both go away when that connection closes."""
    text = str(exc)
    return "Could not set lock" in text or "different configuration" in text
