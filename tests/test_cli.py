"""The `dagster` CLI against the code location, in a subprocess with its own homes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _run(args: list[str], env: dict[str, str], timeout: int = 600) -> str:
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def test_validate_and_materialize_the_whole_chain_through_the_cli(tmp_path: Path) -> None:
    """The README's command, in a fresh DAGSTER_HOME / MM_ASSETS_HOME: down to the checkpoint."""
    env = {
        **os.environ,
        "MM_ASSETS_HOME": str(tmp_path / "home"),
        "DAGSTER_HOME": str(tmp_path / "dagster_home"),
        "MM_ASSETS_DATASETS": str(tmp_path / "no_user_datasets.yaml"),
    }
    (tmp_path / "dagster_home").mkdir()
    _run([str(BIN / "dagster"), "definitions", "validate", "-m", "mm_assets.definitions"], env)
    _run([sys.executable, "-m", "mm_assets.demo", "build"], env)
    out = _run(
        [
            str(BIN / "dagster"),
            "asset",
            "materialize",
            "-m",
            "mm_assets.definitions",
            "--select",
            "*trained_speculator",
            "--partition",
            "demo_sharegpt4v_coco",
        ],
        env,
    )
    assert "RUN_SUCCESS" in out
    tables = tmp_path / "home" / "tables"
    landed = sorted(
        p.parent.parent.name for p in tables.glob("*/dataset=demo_sharegpt4v_coco/data.parquet")
    )
    assert {
        "raw_dataset",
        "coco_image_availability",
        "normalized_conversations",
        "tokenized_samples",
    } <= set(landed)
    glob = tables / "tokenized_samples" / "*" / "data.parquet"
    rows = duckdb.sql(
        f"SELECT count(*), min(num_supervised) FROM read_parquet('{glob}')"
    ).fetchall()[0]
    assert rows[0] > 150 and rows[1] > 0
    checkpoint = tmp_path / "home" / "speculators" / "demo_sharegpt4v_coco"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert (checkpoint / "model.safetensors").stat().st_size > 0
    # the run was recorded in the persistent instance, not an in-memory one
    assert any((tmp_path / "dagster_home").rglob("*.db"))
