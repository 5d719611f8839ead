"""Rows of a local dataset: a json (list), jsonl or parquet file, or a directory of them.

Read a record at a time (memory flat in the source's size). Only files under the entry's
`path` are read. A line or record that cannot be read is a row with a parse error
(quarantined by normalization), never an exception, wherever the reader can go on.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import ijson
import pyarrow.parquet as pq
from ijson.backends import python as ijson_python

from mm_assets.domain.ingest.sources import RawRow

logger = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


def read_local(path: Path, data_files: list[str] | None = None) -> Iterator[RawRow]:
    """Rows of a file, or of every such file in a directory (sorted by name, so the
    source index is stable), or of its `data_files` only, in order; each names its file."""
    if path.is_dir():
        files = _listed_files(path, data_files) if data_files else _all_files(path)
        rows = ((file, row) for file in files for row in _read_file(file))
        for index, (file, row) in enumerate(rows):
            yield RawRow(index, row.record, row.parse_error, file.relative_to(path).as_posix())
        return
    if data_files:
        raise ValueError(
            f"{path} is a file, and 'data_files' chooses files under a directory: set "
            f"'path' to the directory holding {data_files[0]!r}, or remove 'data_files'"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset file {path} does not exist; fix the entry's 'path' in the registry "
            f"(for the demo datasets run `python -m mm_assets.demo build`)"
        )
    for row in _read_file(path):
        yield RawRow(row.source_index, row.record, row.parse_error, path.name)


def _all_files(directory: Path) -> list[Path]:
    found = sorted(p for p in directory.rglob("*") if p.suffix in LOCAL_SUFFIXES)
    files = [p for p in found if _inside(p, directory)]
    for escaped in sorted(set(found) - set(files)):
        logger.warning("not read: %s links outside the dataset's path %s", escaped, directory)
    if not files:
        raise FileNotFoundError(f"{directory} holds no {'/'.join(LOCAL_SUFFIXES)} files")
    return files


def _listed_files(directory: Path, data_files: list[str]) -> list[Path]:
    """The entry's `data_files` under `directory`, in order (a glob's matches sorted)."""
    files: list[Path] = []
    for entry in data_files:
        if Path(entry).is_absolute():
            raise ValueError(
                f"data_files entry {entry!r} is absolute: data_files are relative to the "
                f"entry's 'path' ({directory}); set 'path' to the directory that holds it"
            )
        matches = (
            sorted(p for p in directory.glob(entry) if p.is_file())
            if any(c in entry for c in "*?[")
            else [directory / entry]
            if (directory / entry).is_file()
            else []
        )
        if not matches:
            raise FileNotFoundError(
                f"data_files entry {entry!r} names no file under {directory}; fix the entry's "
                f"'data_files' in the registry (paths relative to its 'path')"
            )
        outside = [m for m in matches if not _inside(m, directory)]
        if outside:
            raise ValueError(
                f"data_files entry {entry!r} reaches {outside[0].resolve()}, outside the "
                f"entry's 'path' {directory}: list files under it (no '..', no link out)"
            )
        files += matches
    return files


def _inside(file: Path, directory: Path) -> bool:
    """Whether `file`, its links and `..` resolved, lies under `directory`'s real path."""
    return file.resolve().is_relative_to(directory.resolve())


def _read_file(path: Path) -> Iterator[RawRow]:
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix == ".json":
        yield from _read_json_list(path)
    elif path.suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        raise ValueError(f"{path}: unsupported file type; use one of {LOCAL_SUFFIXES}")


BATCH_BYTES = 4 << 20  # a Parquet batch decoded: rows of images of MiBs come one at a time


def _read_parquet(path: Path) -> Iterator[RawRow]:
    """Rows in batches of about `BATCH_BYTES` decoded (1 to 64 rows, sized from the row
    groups' byte counts), one row turned into Python at a time. Arrow still decodes a
    page whole (BENCHMARKS.md, "Images inside rows")."""
    file = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    meta = file.metadata
    groups = (meta.row_group(i) for i in range(meta.num_row_groups))
    widest = max((g.total_byte_size / max(g.num_rows, 1) for g in groups), default=1)
    batch_size = int(min(64, max(1, BATCH_BYTES // max(widest, 1))))
    index = 0
    for batch in file.iter_batches(batch_size=batch_size, use_threads=False):
        for row in range(batch.num_rows):
            yield RawRow(index, batch.slice(row, 1).to_pylist()[0])
            index += 1


def _read_jsonl(path: Path) -> Iterator[RawRow]:
    """One row per non-blank line; a line that is not UTF-8 or not JSON is kept as text
    with a parse error naming its line, for normalization to quarantine."""
    with open(path, "rb") as fh:
        index = 0
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            line = raw.decode("utf-8", errors="backslashreplace").rstrip("\r\n")
            try:
                yield RawRow(index, json.loads(raw.decode("utf-8")))
            except UnicodeDecodeError as exc:
                where = f"line {number}: not UTF-8 ({exc.reason} at byte {exc.start})"
                yield RawRow(index, line, where)
            except json.JSONDecodeError as exc:
                yield RawRow(index, line, f"line {number}: invalid JSON: {exc}")
            except RecursionError:
                yield RawRow(index, line[:65536], f"line {number}: nested too deep to parse")
            index += 1


def _read_json_list(path: Path) -> Iterator[RawRow]:
    r"""Records of a `.json` file holding one list, streamed by ijson's C backend (a few
    MB where `json.loads` holds every record: BENCHMARKS.md, "Raw dataset memory");
    `use_float=True` gives int or float as `json.loads` does, never Decimal.

    The C parser refuses some valid JSON (integers beyond 64 bits, a lone low surrogate
    escape `\uDC00`): from such a record on, the exact Python backend reads the rest, so
    no row is lost. A file neither reads fails naming the record and the way out.
    """
    read = 0
    backends = [ijson, ijson_python]
    while backends:
        backend = backends.pop(0)
        with open(path, "rb") as fh:
            _expect_list(path, fh)
            try:
                records = backend.items(fh, "item", use_float=True)
                for record in itertools.islice(records, read, None):
                    yield RawRow(read, record)
                    read += 1
                return
            except (ijson.JSONError, ValueError) as exc:  # UnicodeDecodeError is one
                reason = str(exc).strip().splitlines()[0]
                if backends:
                    logger.warning(
                        "%s: record %d needs the exact JSON parser (%s); reading on with it",
                        path,
                        read,
                        reason,
                    )
                    continue
                raise ValueError(
                    f"{path}: not a valid JSON list of records after record {read} "
                    f"({reason}). Fix or re-download the file, or convert it to .jsonl (one "
                    f"record per line), where a broken line is quarantined on its own"
                ) from exc


def _expect_list(path: Path, fh: BinaryIO) -> None:
    """Refuses a `.json` file that is not a list (streaming would read zero rows)."""
    first = b""
    while not first and (chunk := fh.read(65536)):
        first = chunk.lstrip()[:1]
    fh.seek(0)
    if first != b"[":
        found = {b"": "nothing", b"{": "an object"}.get(first, repr(first.decode("latin-1")))
        raise ValueError(
            f"{path}: expected a JSON list of records ([{{...}}, ...]), but it holds {found}; "
            f"wrap the records in a list, or write them as .jsonl (one record per line)"
        )
