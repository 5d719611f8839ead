"""Results recorded beside what they describe, reused while their inputs are unchanged.

Training a draft and measuring it in vLLM cost accelerator hours. Dagster reruns a step
whenever it is asked to (a backfill, a CLI call, a code-version bump upstream whose data
came out identical), so the step itself checks: a record holds the key of the inputs
that produced a result, and a rerun with the same key reads the record instead of
recomputing. A missing, unreadable or differently keyed record is simply a miss.
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
    """Write atomically, so a crash never leaves a record that reads as valid. `key` is
    the `json_sha256` of everything the payload was computed from."""
    atomic_write_text(path, json.dumps({"key": key, "payload": payload}, indent=1))
