"""Content hashes: what every cache key, sample id and reuse record is made of. One
canonical serialization, so the same content gives the same key everywhere."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def json_sha256(value: Any) -> str:
    """SHA-256 of a JSON-able value (sorted keys, no spaces, UTF-8, others by `str`)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
