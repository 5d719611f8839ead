"""Which images a vLLM server opens itself, and which travel inside the request.

A server opens `file://` images only under one directory, its
`--allowed-local-media-path`. A step's images can lie in more than one place: a
dataset's image root and the store of images that were inside its rows, or the roots of
several datasets. Widening the directory to their common parent would let the server
open any file under it (`/` in the worst case). So the directory stays one narrow root
(`services.media`), and an image outside it is read here and sent as a base64 data URL.
The server then sees exactly the bytes this process read, and opens no other file.
"""

from __future__ import annotations

import base64
import mimetypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import url2pathname


@dataclass(frozen=True)
class ServerAccess:
    """What a request needs besides the server's URL: its API key (never in a repr) and
    the one directory the server opens `file://` images under (None: none)."""

    api_key: str = field(default="EMPTY", repr=False)
    media_dir: Path | None = None


def file_url_path(url: str) -> Path:
    """The file a `file://` URL names, parsed the way vLLM parses it (netloc and path,
    percent-decoded)."""
    parts = urlsplit(url)
    return Path(url2pathname(parts.netloc + parts.path))


def readable_by_server(path: Path, media_dir: Path | None) -> bool:
    """vLLM's own test: the resolved file lies under the resolved directory."""
    return media_dir is not None and Path(media_dir).resolve() in path.resolve().parents


def data_url(path: Path) -> str:
    """The file's bytes as a base64 data URL (vLLM decodes by content, not by type)."""
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def outgoing_url(url: str, media_dir: Path | None) -> str:
    """`url` as sent: a `file://` URL the server may open stays; any other file goes
    inline. Raises `OSError` when the file cannot be read."""
    if not url.startswith("file:"):
        return url
    path = file_url_path(url)
    return url if readable_by_server(path, media_dir) else data_url(path)


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
