"""The fixed cost of a Dagster CLI run: wall time minus the time the steps themselves took.

Every user pays it on every run: loading the code location in the CLI, starting the step
processes where there are any, and Dagster's bookkeeping. Measured on the stages up to
`tokenized_samples` of `demo_sharegpt4v_coco` (no vLLM), in fresh homes:

1. `python -c "import mm_assets.definitions"` in a fresh interpreter (median of 3);
2. `dagster asset materialize -m mm_assets.definitions --select '*tokenized_samples'`,
   twice (a first run, then a rerun of the same);
3. `dg launch --assets '*tokenized_samples'` once (when the checkout is a dg project).

`--repo DIR` measures another checkout with this venv (e.g. a worktree of an older
commit), so two versions compare in one session on the same machine:
`.venv/bin/python -m bench.cli_overhead [--repo DIR]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.homes import REPO, fresh_homes, timed

PARTITION = "demo_sharegpt4v_coco"
STAGES = "*tokenized_samples"  # everything up to tokenization, whatever the commit has
BIN = Path(sys.executable).parent


def _step_seconds(dagster_home: Path) -> list[float]:
    """Summed step seconds of each run in the instance, oldest first (read in a child
    process so this one never imports the measured checkout)."""
    code = (
        "import json, dagster as dg\n"
        "i = dg.DagsterInstance.get()\n"
        "runs = sorted(i.get_runs(), key=lambda r: i.get_run_stats(r.run_id).start_time)\n"
        "print(json.dumps([sum((s.end_time or 0) - (s.start_time or 0)\n"
        "    for s in i.get_run_step_stats(r.run_id)) for r in runs]))\n"
    )
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return json.loads(out.stdout)


def measure(repo: Path, workdir: Path) -> dict:
    env = fresh_homes(workdir, repo)
    dagster_home = Path(env["DAGSTER_HOME"])
    imports = [
        timed([sys.executable, "-c", "import mm_assets.definitions"], env, repo) for _ in range(3)
    ]
    materialize = [str(BIN / "dagster"), "asset", "materialize", "-m", "mm_assets.definitions"]
    walls = [
        timed([*materialize, "--select", STAGES, "--partition", PARTITION], env, repo)
        for _ in range(2)
    ]
    if "[tool.dg]" in (repo / "pyproject.toml").read_text():
        launch = [str(BIN / "dg"), "launch", "--assets", STAGES, "--partition", PARTITION]
        walls.append(timed(launch, env, repo))
    steps = _step_seconds(dagster_home)
    names = ["materialize_first", "materialize_rerun", "dg_launch"][: len(walls)]
    return {
        "repo": str(repo),
        "import_definitions_s": round(statistics.median(imports), 2),
        **{
            name: {
                "wall_s": round(wall, 1),
                "step_s": round(step, 1),
                "fixed_overhead_s": round(wall - step, 1),
            }
            for name, wall, step in zip(names, walls, steps, strict=True)
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cli_overhead")
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout to measure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mm_assets_overhead_") as tmp:
        print(json.dumps(measure(args.repo.resolve(), Path(tmp)), indent=2))


if __name__ == "__main__":
    main()
