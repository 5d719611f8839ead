"""Writing files so that a crash never leaves one that looks valid.

Every writer (tables, blobs, reuse records, training state, checkpoints) writes to a
temporary name in the destination's directory, flushes it to disk, renames it over the
destination and then flushes the directory entry: a reader sees the old version or the
new one, never half of one, even after a power loss.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary_sibling(path: Path, suffix: str = "tmp") -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}.{suffix}")


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """A temporary path beside `final` to write to; on success it replaces `final`
    (fsync'd, renamed, directory fsync'd), on error it is removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(final)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(final.parent)


def atomic_write_text(final: Path, text: str) -> None:
    with atomic_path(final) as tmp:
        tmp.write_text(text)


def move_into_place(source: Path, final: Path) -> None:
    """Move a finished file to `final`: a rename on the same filesystem, else a copy to
    a temporary sibling and a rename, so `final` is never partial."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(source, final)
    except OSError:
        with atomic_path(final) as tmp:
            shutil.copyfile(source, tmp)
        source.unlink(missing_ok=True)
        return
    fsync_path(final.parent)


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """A temporary directory to fill; on success it replaces `final` whole (the old
    version is moved aside first, then removed), on error it is removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(final)
    tmp.mkdir()
    try:
        yield tmp
        for file in tmp.iterdir():
            fsync_path(file)
        fsync_path(tmp)
        old = _temporary_sibling(final, "old")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)
