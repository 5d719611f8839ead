"""The command lines a user runs, in subprocesses with their own homes: `dagster` and
`dg` check the code location, `dagster asset materialize` (the README's command) runs
the whole chain to the checkpoint, and `dg launch` reruns it from the caches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from tests.conftest import SESSION_HOME

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
PARTITION = "demo_sharegpt4v_coco"


def _run(args: list[str], env: dict[str, str], timeout: int = 600) -> str:
    proc = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _latest_metadata(env: dict[str, str], asset: str) -> dict:
    """The newest materialization's metadata of `asset`, read from the CLI's instance
    (in this process: a Python subprocess per read cost 2.8 s, five times)."""
    import dagster as dg

    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey(asset))
    assert event is not None and event.asset_materialization is not None, asset
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


def test_the_whole_chain_through_both_clis(tmp_path: Path, vllm_server, plain_vllm_server) -> None:
    """In a fresh DAGSTER_HOME / MM_ASSETS_HOME: the README's `dagster asset materialize`
    down to the checkpoint on the shipped demo partition (`responses: target`): replies
    and hidden states from the session's vLLM servers, the way
    `MM_ASSETS_VLLM_RESPONSE_URLS` / `MM_ASSETS_VLLM_URLS` point at fleets; short replies,
    two epochs, and no vLLM measurement of the draft (`test_speculator.py` covers it) by
    `--config-json`, to spare time. Then the same selection with `dg launch`, which finds
    everything cached: no generation request, no extraction request, no training."""
    env = {
        **os.environ,
        "MM_ASSETS_HOME": str(tmp_path / "home"),
        "DAGSTER_HOME": str(tmp_path / "dagster_home"),
        "MM_ASSETS_DATASETS": str(tmp_path / "no_user_datasets.yaml"),
        "MM_ASSETS_VLLM_URLS": vllm_server.base_url,
        "MM_ASSETS_VLLM_RESPONSE_URLS": plain_vllm_server.base_url,
    }
    (tmp_path / "dagster_home").mkdir()
    # the session's demo: its server reads images only under the session's image root
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "demo").symlink_to(SESSION_HOME / "demo")
    _run([str(BIN / "dagster"), "definitions", "validate", "-m", "mm_assets.definitions"], env)
    assert "All definitions loaded successfully" in _run([str(BIN / "dg"), "check", "defs"], env)
    assert "demo: built" in _run([sys.executable, "-m", "mm_assets.demo", "build"], env)
    no_measurement = json.dumps(
        {
            "ops": {
                "target_responses": {"config": {"max_tokens": 16}},
                "trained_speculator": {"config": {"measure_in_vllm": False, "epochs": 2}},
            }
        }
    )
    select = ["--select", "*trained_speculator", "--partition", PARTITION]
    select += ["--config-json", no_measurement]
    out = _run(
        [str(BIN / "dagster"), "asset", "materialize", "-m", "mm_assets.definitions", *select], env
    )
    assert "RUN_SUCCESS" in out
    tables = tmp_path / "home" / "tables"
    landed = {p.parent.parent.name for p in tables.glob(f"*/dataset={PARTITION}/data.parquet")}
    assert {"raw_dataset", "normalized_conversations", "tokenized_samples"} <= landed
    glob = tables / "tokenized_samples" / "*" / "data.parquet"
    rows = duckdb.sql(f"SELECT count(*), min(num_supervised) FROM read_parquet('{glob}')")
    count, least = rows.fetchall()[0]
    assert count > 150 and least > 0
    checkpoint = tmp_path / "home" / "speculators" / PARTITION
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    weights = checkpoint / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert _latest_metadata(env, "hidden_states")["requests_sent"] > 0
    assert _latest_metadata(env, "target_responses")["requests_sent"] > 0

    launch = [str(BIN / "dg"), "launch", "--assets", "*trained_speculator"]
    out = _run([*launch, "--partition", PARTITION, "--config-json", no_measurement], env)
    assert "RUN_SUCCESS" in out
    hidden = _latest_metadata(env, "hidden_states")
    assert hidden["requests_sent"] == 0 and hidden["cache_hits"] == count
    responses = _latest_metadata(env, "target_responses")
    assert responses["requests_sent"] == 0 and responses["cache_hits"] > 150
    trained = _latest_metadata(env, "trained_speculator")
    assert trained["reused_checkpoint"] is True and "vllm_acceptance_length" not in trained
    assert weights.stat().st_mtime_ns == written
    # both runs were recorded in the persistent instance, not an in-memory one
    assert any((tmp_path / "dagster_home").rglob("*.db"))
