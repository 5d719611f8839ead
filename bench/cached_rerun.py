"""What a cached rerun of the whole demo chain costs compared with the first run.

In fresh MM_ASSETS_HOME / DAGSTER_HOME directories (the repo's dagster.yaml; managed CPU
vLLM, as `make demo` uses), after `python -m mm_assets.demo build`:

1. first run: docs/running.md's command,
   `dagster asset materialize -m mm_assets.definitions --select '*trained_speculator'
   --partition demo_sharegpt4v_coco`;
2. forced rerun: the same command again, nothing changed;
3. scheduled refresh: `raw_dataset` only (what the schedule runs), then one automation
   evaluation, which should request nothing downstream.

Reports wall seconds per command, summed step seconds from the instance, and from the
rerun: vLLM requests sent, vLLM servers started, whether training and the vLLM
measurement were reused. Alone: `.venv/bin/python -m bench.cached_rerun` (~8 min here).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from bench.homes import (
    fresh_homes,
    materialization_metadata,
    servers_started,
    step_seconds,
    timed,
)

PARTITION = "demo_sharegpt4v_coco"
DAGSTER = str(Path(sys.executable).parent / "dagster")


def _materialize(selection: str, env: dict[str, str]) -> float:
    args = [DAGSTER, "asset", "materialize", "-m", "mm_assets.definitions"]
    return timed([*args, "--select", selection, "--partition", PARTITION], env)


def run(workdir: Path) -> dict:
    env = fresh_homes(workdir)
    home = Path(env["MM_ASSETS_HOME"])
    first = _materialize("*trained_speculator", env)
    rerun = _materialize("*trained_speculator", env)
    refresh = _materialize("raw_dataset", env)

    # read the instance in this process, with the same homes
    os.environ.update({k: env[k] for k in ("MM_ASSETS_HOME", "DAGSTER_HOME")})
    os.environ["MM_ASSETS_DATASETS"] = env["MM_ASSETS_DATASETS"]
    import dagster as dg

    from mm_assets.definitions import defs

    instance = dg.DagsterInstance.get()
    runs = sorted(instance.get_runs(), key=lambda r: instance.get_run_stats(r.run_id).start_time)
    assert len(runs) == 3, [r.run_id for r in runs]

    def steps(run_id: str) -> float:
        return sum(step_seconds(instance, run_id).values())

    def metadata(asset: str, run_id: str) -> dict:
        return materialization_metadata(instance, asset, run_id)

    first_id, rerun_id = runs[0].run_id, runs[1].run_id
    hidden, trained = metadata("hidden_states", rerun_id), metadata("trained_speculator", rerun_id)

    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    requested = sum(tick.get_num_requested(key) for key in defs.resolve_all_asset_keys())
    first_steps = steps(first_id)
    return {
        "first_run_wall_s": round(first, 1),
        "rerun_wall_s": round(rerun, 1),
        "refresh_wall_s": round(refresh, 1),
        "rerun_wall_ratio": round(rerun / first, 3),
        "refresh_wall_ratio": round(refresh / first, 3),
        "first_run_step_s": round(first_steps, 1),
        "rerun_step_s": round(steps(rerun_id), 1),
        "refresh_step_s": round(steps(runs[2].run_id), 1),
        "rerun_step_ratio": round(steps(rerun_id) / first_steps, 3),
        "rerun_steps_s": {k: round(v, 2) for k, v in step_seconds(instance, rerun_id).items()},
        "refresh_step_ratio": round(steps(runs[2].run_id) / first_steps, 3),
        "first_run_vllm_requests": metadata("hidden_states", first_id)["requests_sent"],
        "first_run_vllm_servers_started": servers_started(home, first_id),
        "rerun_vllm_requests": hidden["requests_sent"],
        "rerun_hidden_state_cache_hits": hidden["cache_hits"],
        "rerun_vllm_servers_started": servers_started(home, rerun_id),
        "rerun_reused_checkpoint": trained["reused_checkpoint"],
        "rerun_reused_vllm_measurement": trained.get("vllm_measurement_reused"),
        "automation_requests_after_refresh": requested,
    }


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="mm_assets_rerun_") as tmp:
        print(json.dumps(run(Path(tmp)), indent=2))


if __name__ == "__main__":
    main()
