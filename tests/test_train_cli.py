"""`python -m mm_assets.train` under torchrun: data-parallel training (gloo on CPU here,
NCCL on GPUs) produces the same kind of checkpoint as the asset."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
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


@pytest.mark.long
def test_torchrun_online_each_rank_fetches_its_own_batches_from_the_fleet(
    demo_hidden_states, vllm_server, tmp_path: Path
) -> None:
    """`--hidden-states online` under torchrun, in a home with no stored state: each
    rank fetches the batches it trains on from the shared fleet (MM_ASSETS_VLLM_URLS)
    while it trains; with `keep` what they fetched is left in the blob store."""
    partition = "demo_sharegpt4v_coco"
    for table in ("tokenized_samples", "token_frequencies"):
        src = SESSION_HOME / "tables" / table / f"dataset={partition}" / "data.parquet"
        dest = tmp_path / "tables" / table / f"dataset={partition}" / "data.parquet"
        dest.parent.mkdir(parents=True)
        shutil.copyfile(src, dest)
    env = {
        **os.environ,
        "MM_ASSETS_HOME": str(tmp_path),
        "MM_ASSETS_TARGET_MODEL": str(SESSION_HOME / "demo" / "target"),
        "MM_ASSETS_VLLM_URLS": vllm_server.base_url,
    }
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "-m", "mm_assets.train",
         "--partition", partition, "--epochs", "2", "--draft-vocab-size", "512",
         "--hidden-states", "online"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shares = {
        rank: tuple(map(int, m))
        for rank, *m in re.findall(r"\[rank (\d)\] epoch 1: (\d+) rows, (\d+) fetched", proc.stdout)
    }
    assert set(shares) == {"0", "1"}, proc.stdout[-3000:]
    assert all(rows == fetched > 0 for rows, fetched in shares.values())
    rows = len(pq.read_table(tmp_path / "tables" / "tokenized_samples").to_pylist())
    stored = list((tmp_path / "blobs" / "hidden_states").rglob("*.safetensors"))
    assert shares["0"][0] + shares["1"][0] <= len(stored) <= rows
    assert (tmp_path / "speculators" / partition / "model.safetensors").is_file()
