"""Parquet tables, one file per (table, partition), with a DuckDB catalog of views.

Writes go to a temporary name in the same directory and are renamed into place, so a
crash never leaves a half-written file that looks valid. DuckDB allows one writer
process, so the catalog is not on the write path: a table's view reads its Parquet files
by glob (every partition, present and future) and is created after the table's first
write; when another process holds the catalog at that moment, the next write or
`connect()` creates it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from mm_assets.common.files import atomic_path
from mm_assets.common.hashing import file_sha256

PARTITION_COLUMN = "dataset"


@dataclass(frozen=True)
class WrittenTable:
    """What a write produced: where, how many rows, and a hash of the file's bytes."""

    path: Path
    num_rows: int
    content_hash: str


class BatchWriter:
    """Appends rows (dicts) in batches to an open Parquet writer."""

    def __init__(self, writer: pq.ParquetWriter, schema: pa.Schema, batch_size: int) -> None:
        self._writer = writer
        self._schema = schema
        self._batch_size = batch_size
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
        self.num_rows += len(self._pending)
        self._pending = []


class TableStore:
    """Parquet files under `<root>/tables/<table>/dataset=<partition>/data.parquet`."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.tables_dir = self.root / "tables"
        self.catalog_path = self.root / "catalog.duckdb"

    def path(self, table: str, partition: str) -> Path:
        return self.tables_dir / table / f"{PARTITION_COLUMN}={partition}" / "data.parquet"

    def exists(self, table: str, partition: str) -> bool:
        return self.path(table, partition).is_file()

    @contextmanager
    def writer(
        self, table: str, partition: str, schema: pa.Schema, batch_size: int = 1024
    ) -> Iterator[BatchWriter]:
        """Stream rows into a new version of the table; it replaces the old one on success."""
        final = self.path(table, partition)
        with atomic_path(final) as tmp:
            pq_writer = pq.ParquetWriter(tmp, schema, compression="zstd")
            batch_writer = BatchWriter(pq_writer, schema, batch_size)
            try:
                yield batch_writer
                batch_writer.flush()
            finally:
                pq_writer.close()
        batch_writer.result = WrittenTable(final, batch_writer.num_rows, file_sha256(final))
        self.add_to_catalog([table])

    def write(
        self, table: str, partition: str, rows: Iterable[Mapping[str, Any]], schema: pa.Schema
    ) -> WrittenTable:
        with self.writer(table, partition, schema) as out:
            out.write_many(rows)
        assert out.result is not None
        return out.result

    def read(self, table: str, partition: str, columns: Sequence[str] | None = None) -> pa.Table:
        return pq.read_table(self._existing(table, partition), columns=columns)

    def iter_rows(
        self,
        table: str,
        partition: str,
        columns: Sequence[str] | None = None,
        batch_size: int = 1024,
    ) -> Iterator[dict[str, Any]]:
        """Rows as dicts, read batch by batch so memory stays flat in the table's size."""
        parquet = pq.ParquetFile(self._existing(table, partition))
        for batch in parquet.iter_batches(batch_size=batch_size, columns=columns):
            yield from batch.to_pylist()

    def num_rows(self, table: str, partition: str) -> int:
        return pq.ParquetFile(self._existing(table, partition)).metadata.num_rows

    def _existing(self, table: str, partition: str) -> Path:
        path = self.path(table, partition)
        if not path.is_file():
            raise FileNotFoundError(
                f"table {table!r} has no data for partition {partition!r} ({path}); "
                f"materialize the asset that writes it for this partition first"
            )
        return path

    # -- DuckDB catalog -------------------------------------------------------------

    def table_names(self) -> list[str]:
        if not self.tables_dir.is_dir():
            return []
        return sorted(
            d.name for d in self.tables_dir.iterdir() if d.is_dir() and any(d.glob("*/*.parquet"))
        )

    def _view_sql(self, table: str) -> str:
        glob = (self.tables_dir / table / "*" / "data.parquet").as_posix().replace("'", "''")
        return (
            f'CREATE VIEW IF NOT EXISTS "{table}" AS SELECT * FROM read_parquet('
            f"'{glob}', hive_partitioning = true, union_by_name = true)"
        )

    def add_to_catalog(self, tables: Sequence[str]) -> bool:
        """Create the views these tables lack. False when another process holds the
        catalog (DuckDB's single-writer lock): a later write or `connect()` catches up."""
        try:
            with duckdb.connect(str(self.catalog_path)) as con:
                views = con.execute(
                    "SELECT view_name FROM duckdb_views() WHERE NOT internal"
                ).fetchall()
                present = {name for (name,) in views}
                for table in tables:
                    if table not in present:
                        con.execute(self._view_sql(table))
        except duckdb.IOException:
            return False
        return True

    def connect(self) -> duckdb.DuckDBPyConnection:
        """A read-only SQL connection with every table as a view (`SELECT * FROM <table>`)."""
        self.add_to_catalog(self.table_names())
        if not self.catalog_path.exists():
            raise FileNotFoundError(f"no tables under {self.tables_dir} yet")
        return duckdb.connect(str(self.catalog_path), read_only=True)
