"""Writing files so that a crash never leaves one that looks valid.

Every writer writes to a temporary name beside the destination, fsyncs it, renames it
over the destination and fsyncs the directory (and each directory it created): a reader
sees the old version or the new one, never half of one, even after a power loss.

A write that runs out of space raises `DiskFullError`, which names the path, the bytes
it needed and had, and the fix; the previous version stays and the temporary is removed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from mm_assets.common.crashpoints import crash_point

_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Libraries that wrap the OS error keep only its text (safetensors), or lose even that
# (torch.save): a failure with less than `_NEARLY_FULL_BYTES` left is a full disk.
_DISK_FULL_TEXTS = ("no space left on device", "disk quota exceeded", "os error 28")
_NEARLY_FULL_BYTES = 1 << 20


class DiskFullError(OSError):
    """A write ran out of disk space; the previous version of the file is intact."""


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_regular_file(
    path: Path | str,
    refuse: type[Exception],
    dir_fd: int | None = None,
    one_link: bool = False,
    shown: Path | str | None = None,
) -> tuple[int, os.stat_result]:
    """`path` opened read-only, not through a link at its name nor waiting on a FIFO put
    there, as a regular file (with one link, if `one_link`); else `refuse` (names `shown`)."""
    shown = shown or path
    try:
        fd = os.open(
            path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd
        )
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refuse(f"{shown} is a symbolic link") from exc
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (one_link and st.st_nlink != 1):
        os.close(fd)
        raise refuse(
            f"{shown} is not a regular file{' with one link' if one_link else ''} "
            f"(mode {stat.filemode(st.st_mode)}, {st.st_nlink} links)"
        )
    return fd, st


def make_dirs(path: Path) -> None:
    """`mkdir -p` that flushes each directory it creates into its parent."""
    if path.is_dir():
        return
    make_dirs(path.parent)
    try:
        path.mkdir()
    except FileExistsError:  # made by a concurrent writer, or not a directory (fails later)
        return
    fsync_path(path.parent)


def _host_tag() -> str:
    """This machine (or container: a pod has a hostname, and pids, of its own)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temporary_name(name: str, suffix: str = "tmp") -> str:
    """`.<name>.<pid>@<host>-<random>.<suffix>`: a sweep tells a dead writer's by them."""
    return f".{name}.{os.getpid()}@{_host_tag()}-{uuid.uuid4().hex}.{suffix}"


# (no host: an older version's name, from this machine)
_TEMPORARY = re.compile(r"^\..+\.(\d+)(?:@([0-9a-f]{8}))?-[0-9a-f]{32}\.(tmp|old)$")
# Another machine's temporaries (its pids mean nothing here) go when unchanged this long.
FOREIGN_STALE_S = 6 * 3600.0


def _writer_gone(entry: os.DirEntry, match: re.Match[str]) -> bool:
    host = match.group(2)
    if host is None or host == _host_tag():
        return not psutil.pid_exists(int(match.group(1)))
    try:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime > FOREIGN_STALE_S
    except FileNotFoundError:
        return False


def remove_stale_temporaries(directory: Path) -> int:
    """Remove the temporaries in `directory` whose writer died (another machine's once
    `FOREIGN_STALE_S` old); returns how many."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        if match is None or not _writer_gone(entry, match):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            Path(entry.path).unlink(missing_ok=True)
        removed += 1
    return removed


def _free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _size(path: Path) -> int:
    """Bytes under `path` (a file or a tree); 0 when it is gone."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _is_disk_full(exc: BaseException, directory: Path) -> bool:
    if not isinstance(exc, Exception):
        return False
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
        return True
    if any(text in str(exc).lower() for text in _DISK_FULL_TEXTS):
        return True
    try:
        return _free_bytes(directory) < _NEARLY_FULL_BYTES
    except OSError:
        return False


def _disk_full_error(final: Path, written: int, needed: int | None, free: int) -> DiskFullError:
    if needed:
        need = f"needs ~{_human(needed)}"
    elif written:
        need = f"needs more than the {_human(written)} written before it failed"
    else:
        need = "needs more than was free"
    kept = "the previous version is intact" if final.exists() else "nothing was left there"
    return DiskFullError(
        errno.ENOSPC,
        f"no space left on device writing {final}: it {need}, and {_human(free)} was free "
        f"on that filesystem when the write began; {kept} and the partial file was removed. "
        "Free space there, or point MM_ASSETS_HOME at a larger disk, then rerun.",
    )


@contextmanager
def _replacing(final: Path, tmp: Path | None, expected_bytes: int | None) -> Iterator[None]:
    """On error: remove `tmp`; a full disk becomes a `DiskFullError`."""
    free = _free_bytes(final.parent)
    try:
        yield
    except BaseException as exc:
        written = _size(tmp) if tmp else 0
        full = _is_disk_full(exc, final.parent)  # before removing: the partial file fills it
        if tmp and tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp:
            tmp.unlink(missing_ok=True)
        if full:
            raise _disk_full_error(final, written, expected_bytes, free) from exc
        raise


@contextmanager
def atomic_path(
    final: Path, expected_bytes: int | None = None, sweep: bool = True
) -> Iterator[Path]:
    """A temporary path beside `final` to write to; on success it replaces `final`, on
    error it is removed. `expected_bytes` goes into a `DiskFullError`'s message;
    `sweep=False` skips `remove_stale_temporaries` (a writer that swept already)."""
    tmp = final.with_name(temporary_name(final.name))
    with _replacing(final, tmp, expected_bytes):
        make_dirs(final.parent)
        if sweep:
            remove_stale_temporaries(final.parent)
        yield tmp
        fsync_path(tmp)
        crash_point("before_rename")
        os.replace(tmp, final)
    fsync_path(final.parent)


def atomic_write_text(final: Path, text: str) -> None:
    data = text.encode()
    with atomic_path(final, len(data)) as tmp, open(tmp, "wb") as out:
        out.write(data)


def move_into_place(
    source: Path,
    final: Path,
    verify: Callable[[Path], None] | None = None,
    copy_from: str | None = None,
) -> None:
    """Move a finished file to `final` through a private temporary sibling (renamed, or
    copied across filesystems from `copy_from`: an opened file's `/dev/fd/N`), where
    `verify` checks this move's file (raising refuses it) before the rename over `final`.
    The data is fsync'd: its writer (the vLLM connector) does not, and a power loss could
    otherwise leave `final` short, which a content-addressed store would reuse."""
    size = source.stat().st_size
    copied = False
    with atomic_path(final, size) as tmp:
        try:
            os.replace(source, tmp)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            shutil.copyfile(copy_from or source, tmp)
            copied = True
        if verify is not None:
            verify(tmp)
    if copied:
        source.unlink(missing_ok=True)


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """A temporary directory to fill; on success it replaces `final` whole (the old one
    moved aside, put back if the swap fails), on error it is removed."""
    tmp = final.with_name(temporary_name(final.name))
    old = final.with_name(temporary_name(final.name, "old"))
    with _replacing(final, tmp, None):
        make_dirs(final.parent)
        remove_stale_temporaries(final.parent)
        tmp.mkdir()
        yield tmp
        for path in tmp.rglob("*"):
            fsync_path(path)
        fsync_path(tmp)
        if final.exists():
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            if old.exists():
                os.replace(old, final)
            raise
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)
