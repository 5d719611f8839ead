"""Fresh storage and Dagster homes for benchmarks that run the CLIs in subprocesses, and
what the Dagster instance recorded of those runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def timed(args: list[str], env: dict[str, str], cwd: Path = REPO) -> float:
    """Seconds a command took; its output tail when it fails."""
    started = time.perf_counter()
    proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def home_env(workdir: Path, repo: Path = REPO) -> dict[str, str]:
    """The environment of a user whose homes are under `workdir`: MM_ASSETS_HOME and
    DAGSTER_HOME (the repo's dagster.yaml unless it has one), no user registry, managed
    vLLM."""
    home, dagster_home = workdir / "home", workdir / "dagster_home"
    dagster_home.mkdir(parents=True, exist_ok=True)
    if not (dagster_home / "dagster.yaml").exists():
        shutil.copyfile(repo / "dagster.yaml", dagster_home / "dagster.yaml")
    env = {
        **os.environ,
        "MM_ASSETS_HOME": str(home),
        "DAGSTER_HOME": str(dagster_home),
        "MM_ASSETS_DATASETS": str(workdir / "no_user_datasets.yaml"),
        "PYTHONPATH": str(repo),
    }
    env.pop("MM_ASSETS_VLLM_URLS", None)
    return env


def fresh_homes(workdir: Path, repo: Path = REPO) -> dict[str, str]:
    """The environment of a first-time user: empty homes (`home_env`), the demo built."""
    (workdir / "dagster_home").mkdir(parents=True)
    env = home_env(workdir, repo)
    timed([sys.executable, "-m", "mm_assets.demo", "build"], env, repo)
    return env


def step_seconds(instance: Any, run_id: str) -> dict[str, float]:
    """Each step's seconds in a run, from the instance's step stats: the steps' own time,
    without the CLI loading the code location."""
    return {
        s.step_key: (s.end_time or 0) - (s.start_time or 0)
        for s in instance.get_run_step_stats(run_id)
    }


def materialization_metadata(instance: Any, asset: str, run_id: str) -> dict[str, Any]:
    """The metadata `asset` was materialized with in a run, as plain values."""
    import dagster as dg

    records = instance.fetch_materializations(dg.AssetKey(asset), limit=10).records
    (record,) = [r for r in records if r.run_id == run_id]
    return {k: v.value for k, v in record.asset_materialization.metadata.items()}


def servers_started(home: Path, run_id: str) -> int:
    """vLLM servers a run started: each managed server writes its log under logs/."""
    return len(list((home / "logs").glob(f"vllm*{run_id}.log")))
