"""The vLLM API key, after a real run that used it, is nowhere it could be read back."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
import pytest

from mm_assets.assets.resources import StorageResource, VllmResource
from tests.conftest import PREP_ASSETS, SESSION_HOME

pytestmark = pytest.mark.slow


def _files_holding(directory: Path, secret: bytes) -> list[str]:
    return [
        str(p)
        for p in directory.rglob("*")
        if p.is_file() and not p.is_symlink() and secret in p.read_bytes()
    ]


def test_the_api_key_is_in_no_event_metadata_log_or_file(
    demo_dir: Path, vllm_server, tmp_path: Path
) -> None:
    """The chain to `hidden_states` runs on a fresh root against the session's servers,
    which answer only requests that carry the key (read from `MM_ASSETS_VLLM_API_KEY`).
    Afterwards the key's value is in none of the run's events or metadata, and in no file
    under the storage root or the Dagster home: event-log and run databases, compute
    logs, step logs, tables, and the servers' own logs."""
    from mm_assets.definitions import defs

    key = os.environ["MM_ASSETS_VLLM_API_KEY"]
    assert len(key) >= 24
    root = tmp_path / "root"
    resources = {
        **defs.resources,
        "storage": StorageResource(root=str(root)),
        "vllm": VllmResource(base_urls=[vllm_server.base_url]),
    }
    result = dg.materialize(
        [defs.get_assets_def(name) for name in [*PREP_ASSETS, "hidden_states"]],
        partition_key="demo_sharegpt",
        resources=resources,
        instance=dg.DagsterInstance.get(),
    )
    assert result.success
    (extracted,) = result.asset_materializations_for_node("hidden_states")
    assert extracted.metadata["requests_sent"].value > 0  # the key was used
    events = result.all_events
    assert events and not [e for e in events if key in repr(e)]
    logs = dg.DagsterInstance.get().all_logs(result.run_id)
    assert logs and not [e for e in logs if key in repr(e)]
    secret = key.encode()
    assert _files_holding(root, secret) == []
    assert _files_holding(SESSION_HOME, secret) == []  # the Dagster home and server logs
