"""Storage: Parquet tables per (asset, partition) and a DuckDB catalog over them, on the
storage root or, with an object store URL, on S3/GCS/Azure (`object_tables`)."""

from __future__ import annotations

from pathlib import Path

from mm_assets.storage.object_store import ObjectStore
from mm_assets.storage.tables import TableStore, WrittenTable


def open_tables(root: Path | str, object_store: str | None = None) -> TableStore:
    """The tables of a storage root: under it, or on `object_store` when one is given."""
    if not object_store:
        return TableStore(root)
    from mm_assets.storage.object_tables import ObjectTableStore

    return ObjectTableStore(root, ObjectStore(object_store))


__all__ = ["ObjectStore", "TableStore", "WrittenTable", "open_tables"]
