"""Fresh storage and Dagster homes for benchmarks that run the CLIs in subprocesses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(args: list[str], env: dict[str, str], cwd: Path = REPO) -> float:
    """Seconds a command took; its output tail when it fails."""
    started = time.perf_counter()
    proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def fresh_homes(workdir: Path, repo: Path = REPO) -> dict[str, str]:
    """The environment of a first-time user: empty MM_ASSETS_HOME and DAGSTER_HOME (the
    repo's dagster.yaml), no user registry, managed vLLM, the demo built."""
    home, dagster_home = workdir / "home", workdir / "dagster_home"
    dagster_home.mkdir(parents=True)
    shutil.copyfile(repo / "dagster.yaml", dagster_home / "dagster.yaml")
    env = {
        **os.environ,
        "MM_ASSETS_HOME": str(home),
        "DAGSTER_HOME": str(dagster_home),
        "MM_ASSETS_DATASETS": str(workdir / "no_user_datasets.yaml"),
        "PYTHONPATH": str(repo),
    }
    env.pop("MM_ASSETS_VLLM_URLS", None)
    timed([sys.executable, "-m", "mm_assets.demo", "build"], env, repo)
    return env
