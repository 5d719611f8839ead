"""An object store (S3, GCS, Azure Blob) reached through fsspec, for what every worker of
a cluster must read: tables and trained checkpoints (hidden-state blobs are files vLLM's
connector writes, so they stay on a storage root every worker mounts).

Only stores whose uploads appear whole or not at all are accepted: that is what makes
writing without a rename safe. Credentials and endpoints come from the store's usual
configuration (for S3: `AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, `~/.aws/`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from mm_assets.common.hashing import file_sha256
from mm_assets.common.urls import shown_url, url_password

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

# fsspec protocols whose uploads are atomic, and the package that implements each.
ATOMIC_STORES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
}
ENV_VAR = "MM_ASSETS_OBJECT_STORE"
PUBLISHED = "mm_assets_published.json"  # a published directory's files and their SHA-256


@dataclass(frozen=True)
class ObjectStore:
    """`s3://bucket/prefix`: the prefix under which `tables/` and `speculators/` go."""

    url: str

    def __post_init__(self) -> None:
        scheme, _, rest = self.url.partition("://")
        if scheme not in ATOMIC_STORES or not rest.strip("/"):
            raise ValueError(
                f"{ENV_VAR}={shown_url(self.url)!r} is not an object store URL: use "
                f"<scheme>://<bucket>[/<prefix>] with a scheme among "
                f"{', '.join(ATOMIC_STORES)} (uploads there are atomic), or leave it unset to "
                "keep tables and checkpoints under the storage root"
            )
        if url_password(self.url):  # shown in metadata and errors; fsspec would not use it
            raise ValueError(
                f"{ENV_VAR}={shown_url(self.url)!r} holds a password: the store's credentials "
                "come from its own configuration (for S3: AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY); remove it from the URL"
            )

    @property
    def scheme(self) -> str:
        return self.url.partition("://")[0]

    @cached_property
    def fs(self) -> AbstractFileSystem:
        """One filesystem per store, listing afresh each time: another worker's new
        table version must be seen by the next read."""
        import fsspec

        try:
            return fsspec.filesystem(
                self.scheme, use_listings_cache=False, skip_instance_cache=True
            )
        except ImportError as exc:
            package = ATOMIC_STORES[self.scheme]
            raise ImportError(
                f"{self.url} needs the fsspec driver {package!r}: pip install {package} "
                "(s3fs comes with `pip install -e '.[cluster]'`)"
            ) from exc

    def key(self, *parts: str) -> str:
        """The path the filesystem takes (no scheme): `bucket/prefix/<parts>`."""
        return "/".join([self.url.partition("://")[2].strip("/"), *parts])

    def url_of(self, *parts: str) -> str:
        return f"{self.scheme}://{self.key(*parts)}"


def publish_directory(
    store: ObjectStore, local: Path, *parts: str, entry_point: str = "config.json"
) -> tuple[str, int]:
    """Upload `local`'s files that differ (by SHA-256, listed in `PUBLISHED`) under
    `parts`, and remove those it no longer holds; returns the URL and files uploaded.

    A reader must never load one training's weights with another's config: a changed
    `entry_point` is removed first and uploaded last, and `PUBLISHED` after it, so an
    interrupted upload leaves no checkpoint, or the complete new one."""
    fs, dest = store.fs, store.key(*parts)
    local_hashes = {
        p.name: file_sha256(p)
        for p in sorted(local.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }
    if entry_point not in local_hashes:
        raise FileNotFoundError(f"{local / entry_point} is missing: nothing to publish")
    try:
        remote_hashes = json.loads(fs.cat_file(f"{dest}/{PUBLISHED}"))
    except (FileNotFoundError, ValueError):
        remote_hashes = {}
    if remote_hashes == local_hashes:
        return store.url_of(*parts), 0
    changed = [n for n, h in local_hashes.items() if remote_hashes.get(n) != h]
    for name in (PUBLISHED, *([entry_point] if entry_point in changed else [])):
        if fs.exists(f"{dest}/{name}"):
            fs.rm_file(f"{dest}/{name}")
    for name in sorted(changed, key=lambda n: n == entry_point):  # the entry point last
        fs.put_file(str(local / name), f"{dest}/{name}")
    for remote in fs.ls(dest, detail=False):
        if remote.rsplit("/", 1)[-1] not in local_hashes:
            fs.rm_file(remote)
    fs.pipe_file(f"{dest}/{PUBLISHED}", json.dumps(local_hashes, indent=1).encode())
    return store.url_of(*parts), len(changed)
