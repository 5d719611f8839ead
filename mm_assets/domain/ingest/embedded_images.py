"""Images kept inside a dataset's rows, taken out and named by their content.

Hub vision-language datasets carry their images in the rows: the `datasets.Image` feature
(a struct `{bytes, path}` in Parquet, a dict once read with `Image(decode=False)`), plain
`{"bytes": ...}` dicts, raw bytes, and `data:image/...;base64,...` URLs (alone or in an
OpenAI-style `image_url` part). Tables never hold pixels, so each such image is replaced
in the record by a reference `sha256:<hex>` (the SHA-256 of its bytes) and its bytes are
handed to the caller, which writes them once to `embedded_images_dir(<storage root>)`;
from then on it is a file like any other.

Nothing is decoded or judged here: bytes that are not an image are written all the same,
so the availability probe reports them with a reason instead of the row vanishing at
ingest. A data URL whose base64 does not decode becomes `invalid-image:<reason>`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EMBEDDED_PREFIX = "sha256:"
INVALID_PREFIX = "invalid-image:"
_HEX = re.compile(r"^[0-9a-f]{64}$")
_DATA_IMAGE = re.compile(r"^data:image/[^,;]*((?:;[^,;]*)*),", re.IGNORECASE)


@dataclass
class EmbeddedImages:
    """A record with its embedded images replaced by references, and those images."""

    record: Any
    images: dict[str, bytes] = field(default_factory=dict)  # hex digest -> bytes
    found: int = 0  # images replaced, counting repeats (the same bytes twice count twice)


def embedded_images_dir(storage_root: Path) -> Path:
    """The content-addressed directory of embedded images under a storage root."""
    return Path(storage_root) / "images" / "sha256"


def embedded_image_path(embedded_dir: Path, digest: str) -> Path:
    """Where the image of `digest` (64 hex digits) is stored: two levels keep any one
    directory at a size filesystems list quickly."""
    return Path(embedded_dir) / digest[:2] / digest


def embedded_digest(reference: object) -> str | None:
    """The hex digest of a `sha256:<hex>` reference (None for any other reference)."""
    if isinstance(reference, str) and reference.startswith(EMBEDDED_PREFIX):
        digest = reference[len(EMBEDDED_PREFIX) :]
        return digest if _HEX.match(digest) else None
    return None


def is_embedded_reference(reference: object) -> bool:
    """Whether a reference names an image taken out of a row (`sha256:`), valid or not."""
    return isinstance(reference, str) and reference.startswith(EMBEDDED_PREFIX)


# The keys the format readers take images from (`domain/prep/formats.py`): a `data:image/`
# string is an image under one of them (at any depth), and text anywhere else.
IMAGE_KEYS = frozenset({"image", "images", "image_url", "url", "path"})


def extract_embedded_images(record: Any, image_keys: frozenset[str] = IMAGE_KEYS) -> EmbeddedImages:
    """`record` with every embedded image replaced by `sha256:<hex>` (or by the path of a
    `{bytes: None, path}` struct, or by `invalid-image:<reason>`), and the images found,
    at any nesting. Bytes are images wherever they are; a data URL only under
    `image_keys` (a user's text that starts like one stays text)."""
    found = EmbeddedImages(None)
    found.record = _walk(record, found, image_keys, False)
    return found


def _walk(value: Any, found: EmbeddedImages, keys: frozenset[str], image: bool) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return _store(bytes(value), found)
    if isinstance(value, str):
        is_url = image and value[:11].lower() == "data:image/"
        return _data_url(value, found) if is_url else value
    if isinstance(value, Mapping):
        if "bytes" in value and _is_image_struct(value):
            return _image_struct(value, found)
        # a text part's text is what the user wrote, even if it reads like a data URL
        text = value.get("type") == "text"
        return {
            key: item if text and key == "text" else _walk(item, found, keys, image or key in keys)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_walk(item, found, keys, image) for item in value]
    if _is_decoded_image(value):
        raise TypeError(
            "a record holds a decoded image object: read the source with its image columns "
            "cast to datasets.Image(decode=False), so rows give the image's bytes, not pixels"
        )
    return value


def _is_image_struct(value: Mapping[str, Any]) -> bool:
    """`{bytes: <bytes>, ...}`, or the `datasets.Image` struct `{bytes, path}` whose
    bytes may be null (then it names a file)."""
    data = value["bytes"]
    return isinstance(data, bytes | bytearray | memoryview) or (
        data is None and set(value) == {"bytes", "path"}
    )


def _image_struct(value: Mapping[str, Any], found: EmbeddedImages) -> Any:
    data = value["bytes"]
    if data is not None:
        return _store(bytes(data), found)
    path = value.get("path")
    # bytes null: the struct points at a file (datasets writes this for images it did
    # not embed); no path either: the row has no image here
    return path if isinstance(path, str) and path.strip() else None


def _data_url(url: str, found: EmbeddedImages) -> str:
    match = _DATA_IMAGE.match(url)
    if match is None:
        return f"{INVALID_PREFIX}a data:image URL without a ',' before its data"
    if "base64" not in (p.strip().lower() for p in match.group(1).split(";")):
        return f"{INVALID_PREFIX}a data:image URL that is not base64-encoded (add ';base64')"
    # line breaks are allowed in base64: dropped in one pass, one copy
    payload = url[match.end() :].translate(_NO_WHITESPACE)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        return f"{INVALID_PREFIX}the data URL's base64 does not decode ({exc})"
    return _store(data, found)


_NO_WHITESPACE = dict.fromkeys(map(ord, " \t\n\r\f\v"))


def _store(data: bytes, found: EmbeddedImages) -> str:
    digest = hashlib.sha256(data).hexdigest()
    found.images.setdefault(digest, data)
    found.found += 1
    return EMBEDDED_PREFIX + digest


def _is_decoded_image(value: Any) -> bool:
    """A PIL image (checked by name: this module must not decode anything itself)."""
    return any(c.__module__.startswith("PIL.") and c.__name__ == "Image" for c in type(value).mro())


def embedded_references(record: Any) -> list[str]:
    """The `sha256:` references a record holds after `extract_embedded_images`, in order."""
    if isinstance(record, str):
        return [record] if embedded_digest(record) else []
    if isinstance(record, Mapping):
        return [ref for item in record.values() for ref in embedded_references(item)]
    if isinstance(record, list | tuple):
        return [ref for item in record for ref in embedded_references(item)]
    return []
