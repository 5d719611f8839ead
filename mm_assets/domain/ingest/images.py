"""Resolving image references under a root and probing their headers.

Nothing here decodes pixels: Pillow's `Image.open` parses the header (size, format) and
the file's bytes are streamed once for a content hash and a cheap end-of-file check
(truncated JPEG/PNG/GIF files lack their trailer). A reference that resolves outside
the root — `..`, an absolute path elsewhere, a symlink pointing out — is refused before
the file is opened. Images taken out of the rows (`embedded_images.py`, `sha256:<hex>`)
resolve to the embedded-image directory instead and are probed alike.

The probe says what vLLM will do with the file: it opens only the formats vLLM decodes,
reports the size vLLM sees (after the EXIF orientation, which vLLM applies and
tokenization must count tokens for), and refuses images of more than 8 bits per channel,
which vLLM's conversion to RGB clips to white.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from PIL import ExifTags, Image, UnidentifiedImageError

from mm_assets.domain.ingest.embedded_images import (
    INVALID_PREFIX,
    embedded_digest,
    embedded_image_path,
    is_embedded_reference,
)

# Pillow's own default warning threshold (~89.5 MP); above it decoding is a bomb risk.
DEFAULT_MAX_PIXELS = 89_478_485
# vLLM decodes an image whole before the target's processor scales it down to its
# `max_pixels`: past this multiple of it, decoding costs far more than the target keeps.
# Not 1: processors scale larger images down rather than refuse them.
PROCESSOR_PIXELS_MULTIPLE = 32
# A file larger than this is refused before anything reads it: vLLM would read it whole
# for every request that shows it.
DEFAULT_MAX_BYTES = 64 << 20
_TAIL_BYTES = 4096
# What vLLM decodes (its serving allow-list, `vllm.multimodal.image.ALLOWED_IMAGE_FORMATS`
# in vLLM 0.32; a test keeps the two equal). EPS, for one, is not in it.
_VLLM_FORMAT_NAMES = """AVIF BLP BMP CUR DCX DDS DIB FITS FLI FTEX GBR GIF ICNS ICO IM IMT
IPTC JPEG JPEG2000 MCIDAS MSP PCD PCX PIXAR PNG PPM PSD QOI SGI SPIDER SUN TGA TIFF WEBP XBM
XPM XVTHUMB"""
VLLM_FORMATS = tuple(_VLLM_FORMAT_NAMES.split())
# Pillow modes of more than 8 bits per channel: converted to RGB, they clip to white.
DEEP_MODES = frozenset({"I", "F", "I;16", "I;16B", "I;16L", "I;16N", "I;16S", "I;32"})
_TRANSPOSED = frozenset({5, 6, 7, 8})  # EXIF orientations that swap width and height


class ImageStatus(StrEnum):
    OK = "ok"
    MISSING = "missing"
    EMPTY = "empty"
    UNREADABLE = "unreadable"
    OUTSIDE_ROOT = "outside_root"
    TOO_LARGE = "too_large"
    INVALID_REFERENCE = "invalid_reference"


@dataclass(frozen=True)
class ImageProbe:
    """What the availability stage records for one referenced image."""

    reference: str
    path: str | None
    status: ImageStatus
    detail: str = ""
    width: int | None = None
    height: int | None = None
    format: str | None = None
    bytes: int | None = None
    content_hash: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is ImageStatus.OK

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["status"] = self.status.value
        return row


def resolve_reference(
    root: Path, reference: object, strip_prefix: str = "", embedded_dir: Path | None = None
) -> Path | ImageProbe:
    """The real path a reference names under `root` (a `sha256:` one: in `embedded_dir`),
    or a probe saying why it is refused."""
    ref = str(reference)
    if not isinstance(reference, str) or not reference.strip():
        return _invalid(ref, "not a non-empty string")
    if is_embedded_reference(reference) or reference.startswith(INVALID_PREFIX):
        return _resolve_embedded(reference, embedded_dir)
    if reference[:5].lower() == "data:":
        return _invalid(
            ref, "a data: URL that is not data:image/…; only images are read from data URLs"
        )
    if reference.startswith("file://"):
        reference = reference[len("file://") :]
    elif "://" in reference:
        return _invalid(ref, "only local files are supported")
    if strip_prefix and reference.startswith(strip_prefix):
        reference = reference[len(strip_prefix) :]
    if "\x00" in reference:  # no file name holds one; the OS calls would raise
        return _invalid(ref, "holds a NUL byte")
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(real_root / reference))  # resolves `..` and symlinks
    if not real.is_relative_to(real_root):
        return ImageProbe(
            ref, None, ImageStatus.OUTSIDE_ROOT, f"resolves to {real}, outside {real_root}"
        )
    return real


def _invalid(reference: str, detail: str) -> ImageProbe:
    return ImageProbe(reference, None, ImageStatus.INVALID_REFERENCE, detail)


def _resolve_embedded(reference: str, embedded_dir: Path | None) -> Path | ImageProbe:
    """The stored file of an image taken out of a row, or why there is none."""
    if reference.startswith(INVALID_PREFIX):
        return _invalid(
            reference,
            reference[len(INVALID_PREFIX) :] or "an embedded image that could not be read",
        )
    digest = embedded_digest(reference)
    if digest is None:
        return _invalid(
            reference, "a sha256: reference must be 'sha256:' followed by 64 lowercase hex digits"
        )
    if embedded_dir is None:
        return _invalid(
            reference,
            "an embedded image, but no embedded-image directory was given to resolve it in",
        )
    return embedded_image_path(embedded_dir, digest)


def probe_image(
    reference: str,
    path: Path,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ImageProbe:
    """Header facts and a content hash for one resolved image, without decoding pixels."""

    def refused(status: ImageStatus, detail: str, **facts: Any) -> ImageProbe:
        return ImageProbe(reference, str(path), status, detail, **facts)

    try:
        stat = path.stat()
    except FileNotFoundError:
        return refused(ImageStatus.MISSING, "no such file")
    except OSError as exc:
        return refused(ImageStatus.UNREADABLE, f"stat failed: {exc}")
    if not path.is_file():
        return refused(ImageStatus.UNREADABLE, "not a regular file")
    if stat.st_size == 0:
        return refused(ImageStatus.EMPTY, "zero bytes", bytes=0)
    if stat.st_size > max_bytes:
        too_big = f"{stat.st_size} bytes > limit {max_bytes}"
        return refused(ImageStatus.TOO_LARGE, too_big, bytes=stat.st_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path, formats=VLLM_FORMATS) as image:  # parses the header only
                width, height = displayed_size(image)
                fmt, mode = image.format, image.mode
    except Image.DecompressionBombError as exc:
        return refused(ImageStatus.TOO_LARGE, str(exc), bytes=stat.st_size)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        detail = f"not an image in a format vLLM decodes: {exc}"
        return refused(ImageStatus.UNREADABLE, detail, bytes=stat.st_size)
    facts = {"width": width, "height": height, "format": fmt, "bytes": stat.st_size}
    if mode in DEEP_MODES:
        deep = f"{mode} pixels: vLLM's conversion to RGB clips them to white; save as 8-bit"
        return refused(ImageStatus.UNREADABLE, deep, **facts)
    if width * height > max_pixels:
        too_many = f"{width}x{height} = {width * height} pixels > limit {max_pixels}"
        return refused(ImageStatus.TOO_LARGE, too_many, **facts)
    try:
        digest, tail = _hash_and_tail(path)
    except OSError as exc:
        return refused(ImageStatus.UNREADABLE, f"read failed: {exc}", **facts)
    if not trailer_present(fmt, tail):
        return refused(
            ImageStatus.UNREADABLE, f"truncated {fmt}: end-of-image marker missing", **facts
        )
    return ImageProbe(reference, str(path), ImageStatus.OK, "", content_hash=digest, **facts)


def displayed_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) as shown: vLLM turns the pixels by the EXIF orientation first."""
    width, height = image.size
    try:
        orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    except Exception:  # a broken EXIF block: vLLM ignores it too (`normalize_image`)
        return width, height
    return (height, width) if orientation in _TRANSPOSED else (width, height)


def _hash_and_tail(path: Path) -> tuple[str, bytes]:
    digest = hashlib.sha256()
    tail = b""
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            tail = (tail + chunk)[-_TAIL_BYTES:]
    return digest.hexdigest(), tail


def trailer_present(fmt: str | None, tail: bytes) -> bool:
    """Whether the file ends the way a complete file of its format does. Formats without
    a cheap trailer check pass; vLLM rejects anything still broken per sample."""
    if fmt == "JPEG":
        return b"\xff\xd9" in tail  # EOI; tolerate padding some encoders append
    if fmt == "PNG":
        return b"IEND\xaeB`\x82" in tail[-64:]
    if fmt == "GIF":
        return tail.rstrip(b"\x00").endswith(b";")
    return True


def probe_reference(
    root: Path,
    reference: object,
    strip_prefix: str = "",
    max_pixels: int = DEFAULT_MAX_PIXELS,
    embedded_dir: Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ImageProbe:
    """The probe of one reference (`resolve_reference`)."""
    resolved = resolve_reference(root, reference, strip_prefix, embedded_dir)
    if isinstance(resolved, ImageProbe):
        return resolved
    if is_embedded_reference(reference) and embedded_dir is not None:
        return _probe_embedded(str(reference), resolved, embedded_dir, max_pixels, max_bytes)
    return probe_image(str(reference), resolved, max_pixels, max_bytes)


def _probe_embedded(
    reference: str, path: Path, embedded_dir: Path, max_pixels: int, max_bytes: int
) -> ImageProbe:
    """A stored image: a plain file in the store whose bytes hash to its name."""
    real_store = Path(os.path.realpath(embedded_dir))
    if path.is_symlink() or not Path(os.path.realpath(path)).is_relative_to(real_store):
        detail = "a link in the embedded-image store (stored images are plain files)"
        return ImageProbe(reference, str(path), ImageStatus.OUTSIDE_ROOT, detail)
    probe = probe_image(reference, path, max_pixels, max_bytes)
    if probe.status is ImageStatus.MISSING:
        detail = "not in the embedded-image directory: materialize raw_dataset again"
        return replace(probe, detail=detail)
    if probe.ok and probe.content_hash != embedded_digest(reference):
        detail = f"its bytes do not match its name: delete {path} and materialize raw_dataset"
        return replace(probe, status=ImageStatus.UNREADABLE, detail=detail)
    return probe


def processor_max_pixels(processor: Any) -> int | None:
    """The most pixels the target's image processor keeps of an image (it scales larger
    ones down), or None when it declares no pixel budget. Read from what the processor
    declares, never from a model name: a `max_pixels` attribute or `size["max_pixels"]`,
    else `size["longest_edge"]` for processors whose kwargs declare `max_pixels`
    (transformers 5 keeps Qwen2-VL-style budgets there; elsewhere it is an edge length)."""
    image_processor = getattr(processor, "image_processor", processor)
    size = getattr(image_processor, "size", None)
    declared = getattr(image_processor, "max_pixels", None) or _size_entry(size, "max_pixels")
    kwargs = getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {})
    if declared is None and "max_pixels" in kwargs:
        declared = _size_entry(size, "longest_edge")
    if isinstance(declared, int | float) and not isinstance(declared, bool) and declared >= 1:
        return int(declared)
    return None


def _size_entry(size: Any, key: str) -> Any:
    try:
        return size[key] if size is not None else None
    except (KeyError, TypeError, AttributeError):
        return None


def pixel_cap_for(processor_pixels: int | None) -> int:
    """The probe's default pixel cap: `PROCESSOR_PIXELS_MULTIPLE` times what the target's
    processor keeps, never above Pillow's bomb threshold."""
    if processor_pixels is None:
        return DEFAULT_MAX_PIXELS
    return min(DEFAULT_MAX_PIXELS, PROCESSOR_PIXELS_MULTIPLE * processor_pixels)
