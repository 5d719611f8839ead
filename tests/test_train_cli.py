"""`python -m mm_assets.train` under torchrun: data-parallel training (gloo on CPU here,
NCCL on GPUs) produces the same kind of checkpoint as the asset."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SESSION_HOME

pytestmark = pytest.mark.slow


def test_torchrun_two_processes_train_and_rank_zero_saves(
    demo_hidden_states, tmp_path: Path
) -> None:
    """In a copy of the storage root (what another worker mounting it elsewhere, or a
    restored backup, sees): the manifest's blob paths are relative and resolve there."""
    partition = "demo_sharegpt4v_coco"
    for table in ("tokenized_samples", "hidden_states_manifest", "token_frequencies"):
        src = SESSION_HOME / "tables" / table / f"dataset={partition}" / "data.parquet"
        dest = tmp_path / "tables" / table / f"dataset={partition}" / "data.parquet"
        dest.parent.mkdir(parents=True)
        shutil.copyfile(src, dest)
    shutil.copytree(SESSION_HOME / "blobs" / "hidden_states", tmp_path / "blobs" / "hidden_states")
    env = {
        **os.environ,
        "MM_ASSETS_HOME": str(tmp_path),
        "MM_ASSETS_TARGET_MODEL": str(SESSION_HOME / "demo" / "target"),
    }
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "-m", "mm_assets.train",
         "--partition", partition, "--epochs", "2", "--draft-vocab-size", "512"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 0] epoch 2/2" in proc.stdout and "[rank 1] epoch 2/2" in proc.stdout
    config = json.loads((tmp_path / "speculators" / partition / "config.json").read_text())
    assert config["draft_vocab_size"] == 512 and config["mm_assets"]["epochs"] == 2
    assert (tmp_path / "speculators" / partition / "model.safetensors").is_file()
