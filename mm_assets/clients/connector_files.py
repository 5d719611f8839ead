"""The files vLLM's hidden-states connector writes: `<request id>.safetensors` directly
inside its `shared_storage_path`, beside a `.lock` it holds exclusively while writing.

A path in a server's answer is only a claim: an external fleet, a compromised server or
a process that took the port can answer with any path. `ConnectorDir` is the one rule:
a reported path is used only when it names a regular file directly inside the step's
connector directory as the connector names it, opened without following a link;
anything else is `OutsideConnectorDir` and nothing is touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mm_assets.common.files import open_regular_file

# `<request id>.safetensors` (ids such as `cmpl-<hex>-0-<hex>`): no separator, no leading dot
CONNECTOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,250}\.safetensors")


class OutsideConnectorDir(Exception):
    """A reported path that is not a connector file of the step's own directory."""


@dataclass(frozen=True)
class ConnectorFile:
    """A connector file opened and checked once (`open_regular_file`): `read_path` reads
    that very file, whatever its name points at now."""

    dir: Path
    name: str
    fd: int
    st: os.stat_result

    @property
    def path(self) -> Path:
        return self.dir / self.name

    @property
    def read_path(self) -> str:
        """The opened file itself (`/dev/fd/N`), for readers that take a path."""
        return f"/dev/fd/{self.fd}"

    def is_same(self, path: Path) -> bool:
        """Whether `path` (not followed) is the file that was opened and checked."""
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            return False
        return (now.st_dev, now.st_ino) == (self.st.st_dev, self.st.st_ino)

    def moved_to(self, path: Path) -> bool:
        """Whether the file moved to `path` is this one: renamed on its own filesystem, a
        regular file of the same size where it was copied to another."""
        now = os.lstat(path)
        if now.st_dev == self.st.st_dev:
            return now.st_ino == self.st.st_ino
        return stat.S_ISREG(now.st_mode) and now.st_size == self.st.st_size


@dataclass(frozen=True)
class ConnectorDir:
    """The directory a step's servers write hidden states into, as this machine sees it;
    `path_map`: how a path an external server reports reads here."""

    path: Path
    path_map: Callable[[str], str] = lambda p: p

    def name_of(self, reported: str) -> str:
        """The file name when `reported` names a connector file directly inside this
        directory, compared as written (`..` and links are never resolved)."""
        local = PurePosixPath(self.path_map(reported))
        if local.parent != PurePosixPath(self.path) or not CONNECTOR_NAME.fullmatch(local.name):
            raise OutsideConnectorDir(
                f"the server reported {reported!r}, which is not a connector file "
                f"(<request id>.safetensors) directly inside {self.path}"
            )
        return local.name

    @contextmanager
    def _dir_fd(self) -> Iterator[int]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise OutsideConnectorDir(f"{self.path} is not a directory (a link?)") from exc
            raise
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def open(self, reported: str, lock_timeout_s: float) -> Iterator[ConnectorFile]:
        """The reported file, once its writer released it, opened and checked;
        `FileNotFoundError` or `TimeoutError` when it never came."""
        name = self.name_of(reported)
        with self._dir_fd() as dir_fd:
            _wait_for_writer(dir_fd, name, lock_timeout_s)
            fd, st = open_regular_file(
                name, OutsideConnectorDir, dir_fd, one_link=True, shown=self.path / name
            )
        try:
            yield ConnectorFile(self.path, name, fd, st)
        finally:
            os.close(fd)

    def discard(self, reported: str) -> None:
        """Remove a connector file and its lock where the rule accepts the file (or it is
        gone): anything else (outside, a link, more links) is left as it is, lock too."""
        try:
            name = self.name_of(reported)
            with self._dir_fd() as dir_fd:
                for entry in (name, f"{name}.lock"):
                    try:
                        st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                        return
                    os.unlink(entry, dir_fd=dir_fd)
        except (OutsideConnectorDir, FileNotFoundError):  # no such directory (here)
            return


def _wait_for_writer(dir_fd: int, name: str, timeout_s: float) -> None:
    """Block until the connector released its exclusive lock on `<name>.lock` (or, with
    no lock file, until the file exists); a link in either place is not waited on."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd, _ = open_regular_file(f"{name}.lock", OutsideConnectorDir, dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            finally:
                os.close(fd)
        except FileNotFoundError:
            with contextlib.suppress(FileNotFoundError):  # no lock file: the file itself
                os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                return
        except BlockingIOError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} still locked by the writer after {timeout_s:.0f}s")
        time.sleep(0.01)
