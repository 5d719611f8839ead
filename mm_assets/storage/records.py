"""Results recorded beside what they describe, reused while their inputs are unchanged.

Training and measuring a draft cost accelerator hours, and Dagster reruns a step whenever
asked (a backfill, an upstream code-version bump with identical data), so the step checks:
a record holds the key of the inputs that produced a result, and a rerun with the same
key reads it instead of recomputing. A missing, unreadable or other-keyed record misses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mm_assets.common.files import atomic_write_text


def load_record(path: Path, key: str) -> dict[str, Any] | None:
    """The payload recorded under `key`, or None when there is none for these inputs."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    payload = record.get("payload")
    return payload if isinstance(payload, dict) else None


def save_record(path: Path, key: str, payload: dict[str, Any]) -> None:
    """Write atomically; `key` is the `json_sha256` of what the payload was computed from."""
    atomic_write_text(path, json.dumps({"key": key, "payload": payload}, indent=1))
