"""Which images a vLLM server opens itself, and which travel inside the request.

A server opens `file://` images only under its `--allowed-local-media-path`. A step's
images can lie under several roots, and widening the directory to their common parent
would let the server open any file under it (`/` at worst). So it stays one narrow root
(`services.media`), and an image outside it is read here and sent as a base64 data URL:
the server sees exactly the bytes this process read.

Those bytes are the ones the availability stage probed: a file URL carries the probe's
hash as its fragment (`#sha256=<hex>`), and the inline read refuses a link at the name,
reads at most `MAX_INLINE_BYTES` and checks the hash. A changed file fails its request.
"""

from __future__ import annotations

import base64
import hashlib
import mimetypes
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

from mm_assets.common.files import open_regular_file
from mm_assets.common.urls import HASH_FRAGMENT

# The most a request carries inline: also the ceiling of `max_image_bytes`, so every file
# the probe passed fits, while a file swapped for a larger one since is never read whole.
MAX_INLINE_BYTES = 256 << 20


class ImageNotAsProbed(OSError):
    """An image to send inline is not the file its probe checked (its request fails)."""


@dataclass(frozen=True)
class ServerAccess:
    """What a request needs besides the server's URL: its API key (never in a repr) and
    the one directory the server opens `file://` images under (None: none)."""

    api_key: str = field(default="EMPTY", repr=False)
    media_dir: Path | None = None


def file_url_path(url: str) -> Path:
    """The file a `file://` URL names, parsed as vLLM parses it (netloc + path, decoded)."""
    parts = urlsplit(url)
    return Path(url2pathname(parts.netloc + parts.path))


def read_as_probed(path: Path, sha256: str | None, max_bytes: int = MAX_INLINE_BYTES) -> bytes:
    """The file's bytes, never through a link at its name, at most `max_bytes`, and (with
    the probe's `sha256`) exactly the bytes it hashed; else `ImageNotAsProbed`."""
    fd, _ = open_regular_file(path, ImageNotAsProbed)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ImageNotAsProbed(f"{path} holds more than {max_bytes} bytes")
    if sha256 is not None and (found := hashlib.sha256(data).hexdigest()) != sha256:
        raise ImageNotAsProbed(
            f"{path} changed since its probe (its bytes hash to {found[:16]}…, "
            f"the probe's to {sha256[:16]}…)"
        )
    return data


def outgoing_url(url: str, media_dir: Path | None, max_bytes: int = MAX_INLINE_BYTES) -> str:
    """`url` as sent: a `file://` URL the server may open stays (less the hash fragment);
    any other file goes inline as a base64 data URL (vLLM decodes by content, not type),
    read by `read_as_probed` (`OSError` when it is not the file probed)."""
    if not url.startswith("file:"):
        return url
    plain, _, fragment = url.partition("#")  # a `#` in a name is percent-encoded
    path = file_url_path(plain)
    # vLLM's own test: the resolved file lies under the resolved directory
    if media_dir is not None and Path(media_dir).resolve() in path.resolve().parents:
        return plain
    data = read_as_probed(path, fragment.removeprefix(HASH_FRAGMENT) or None, max_bytes)
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(data).decode('ascii')}"


def outgoing_messages(
    messages: list[dict[str, Any]], media_dir: Path | None
) -> list[dict[str, Any]]:
    """Chat messages with each image part's URL as `outgoing_url` makes it."""

    def part(p: dict[str, Any]) -> dict[str, Any]:
        if p.get("type") != "image_url":
            return p
        return {
            **p,
            "image_url": {**p["image_url"], "url": outgoing_url(p["image_url"]["url"], media_dir)},
        }

    return [
        m if isinstance(m["content"], str) else {**m, "content": [part(p) for p in m["content"]]}
        for m in messages
    ]
