"""Storage: Parquet tables per (asset, partition) and a DuckDB catalog over them."""

from mm_assets.storage.tables import TableStore, WrittenTable

__all__ = ["TableStore", "WrittenTable"]
