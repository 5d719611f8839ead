"""Each training lever against today's recipe, measured in vLLM, on both demo partitions.

From a home where `make demo` ran (`--source-home`: its tables and stored hidden states,
read in place, and its drafts as warm-start points), each lever retrains a partition's
draft with `dagster asset materialize --select trained_speculator` and the registry's demo
settings plus the lever's (same rows, seed, epochs), and vLLM measures it on the held-out
prompts. Per run: vLLM's acceptance length and per-position rates, the offline estimate
on the same replies, the held-out estimate after every epoch (the warm-start curve), the
kept epoch, lossless generations and the step's seconds (2 shared cores: ratios of times
in one run only).

`speculators' recipe` is the peer comparison: speculators' trainer cannot run on CPU (its
device falls back to cuda:0), so its defaults run in this loop.

Why: a recipe is judged by what vLLM accepts, on a target whose answers mean something.
Prints a Markdown block for BENCHMARKS.md, then the results as JSON.
`.venv/bin/python -m bench.training_levers [--partitions P ...] [--levers NAME ...]
[--source-home DIR] [--out FILE]`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.homes import REPO, home_env, materialization_metadata, step_seconds, timed

PARTITIONS = ("demo_sharegpt4v_coco", "demo_sharegpt")
WARM_FROM = {"demo_sharegpt4v_coco": "demo_sharegpt", "demo_sharegpt": "demo_sharegpt4v_coco"}
LEVERS: dict[str, dict[str, Any]] = {
    "today": {},
    "loss lk_hybrid": {"loss": "lk_hybrid"},
    "loss nla": {"loss": "nla"},
    "loss kl+tv": {"loss": "kl=0.5,tv=0.5"},
    "cosine, 5% warmup": {"lr_schedule": "cosine", "warmup_ratio": 0.05},
    "muon": {"optimizer": "muon"},
    "noise 0.05": {"noise_std": 0.05},
    "best epoch": {"keep": "best_acceptance"},
    "EAGLE-3.1 norms": {"fc_norm": True, "norm_output": True},
    "warm start": {},  # init_from: the other partition's demo draft (WARM_FROM)
    "warm start, lr 1e-3": {"learning_rate": 1.0e-3},  # a fine-tune's gentler step
    "today, seed 1": {"seed": 1},  # the noise floor: another split, init and order
    "muon + kl/tv": {"optimizer": "muon", "loss": "kl=0.5,tv=0.5"},
    # speculators' trainer's defaults (its trainer needs an accelerator: on CPU its recipe
    # runs in this loop, whose model and losses compute what its own do, test_conformance)
    # without its weight decay (0.01 AdamW, 0.1 Muon; not a setting here)
    "speculators' recipe": {
        "optimizer": "muon",
        "lr_schedule": "linear",
        "warmup_ratio": 0.01,
        "learning_rate": 1.0e-3,
    },
    # the same at the demo's learning rate (its 1e-3 is meant for 20 epochs of real data)
    "speculators' recipe, lr 3e-3": {
        "optimizer": "muon",
        "lr_schedule": "linear",
        "warmup_ratio": 0.01,
    },
}
MEASURED = {"measure_in_vllm": True, "measure_untrained_in_vllm": False}
KEPT = (
    "vllm_acceptance_length", "vllm_per_position_acceptance", "vllm_acceptance_length_estimate",
    "vllm_generations_same_as_target", "vllm_prompts", "held_out_acceptance_per_epoch",
    "kept_epoch", "acceptance_length_estimate", "train_tokens_per_s", "init_from",
)  # fmt: skip


def bench_home(source: Path, workdir: Path) -> dict[str, str]:
    """A home reading the source's tables and stored states (linked, never written:
    the drafts trained here go to this home's own speculators/)."""
    env = home_env(workdir)
    home = Path(env["MM_ASSETS_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source / "tables", home / "tables")
    for linked in ("blobs", "demo", "images"):
        if (source / linked).exists():
            (home / linked).symlink_to(source / linked)
    return env


def lever_config(name: str, partition: str, source: Path) -> dict[str, Any]:
    settings = dict(LEVERS[name])
    if name.startswith("warm start"):
        settings["init_from"] = str(source / "speculators" / WARM_FROM[partition])
    return {"ops": {"trained_speculator": {"config": {**MEASURED, **settings}}}}


def run_lever(env: dict[str, str], name: str, partition: str, source: Path) -> dict[str, Any]:
    import dagster as dg

    config = lever_config(name, partition, source)
    dagster = str(Path(sys.executable).parent / "dagster")
    args = [dagster, "asset", "materialize", "-m", "mm_assets.definitions",
            "--select", "trained_speculator", "--partition", partition,
            "--config-json", json.dumps(config)]  # fmt: skip
    wall = timed(args, env)
    os.environ["DAGSTER_HOME"] = env["DAGSTER_HOME"]
    with dg.DagsterInstance.get() as instance:
        run = instance.get_runs(limit=1)[0]
        metadata = materialization_metadata(instance, "trained_speculator", run.run_id)
        seconds = step_seconds(instance, run.run_id)
    row = {key: metadata.get(key) for key in KEPT}
    return row | {"lever": name, "partition": partition, "wall_s": round(wall, 1),
                  "step_s": round(sum(seconds.values()), 1)}  # fmt: skip


def epochs_to_reach(curve: list[float | None], goal: float | None) -> int | None:
    """The first epoch whose held-out estimate reaches `goal` (None: never)."""
    if goal is None:
        return None
    return next((e for e, a in enumerate(curve, 1) if a is not None and a >= goal), None)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| partition | lever | vLLM acceptance | vs today | per position | estimate | "
        "lossless | kept epoch | step s |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    today = {r["partition"]: r["vllm_acceptance_length"] for r in rows if r["lever"] == "today"}
    for r in rows:
        base, got = today.get(r["partition"]), r["vllm_acceptance_length"]
        change = f"{100 * (got / base - 1):+.1f}%" if base and got else ""
        per = ", ".join(f"{p:.2f}" for p in r["vllm_per_position_acceptance"] or [])
        lossless = f"{r['vllm_generations_same_as_target']}/{r['vllm_prompts']}"
        lines.append(
            f"| {r['partition']} | {r['lever']} | {got:.3f} | {change} | {per} | "
            f"{r['vllm_acceptance_length_estimate']:.3f} | {lossless} | {r['kept_epoch']} | "
            f"{r['step_s']} |"
        )
    lines += ["", "Held-out estimate after each epoch (warm start against today's):", ""]
    for partition in dict.fromkeys(r["partition"] for r in rows):
        mine = {r["lever"]: r for r in rows if r["partition"] == partition}
        if "today" in mine and "warm start" in mine:
            scratch = mine["today"]["held_out_acceptance_per_epoch"]
            warm = mine["warm start"]["held_out_acceptance_per_epoch"]
            reached = epochs_to_reach(warm, scratch[-1])
            lines.append(
                f"- {partition}: from scratch {scratch}; warm {warm}; today's final "
                f"{scratch[-1]} reached warm after {reached} of {len(scratch)} epochs"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.training_levers")
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS))
    parser.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    parser.add_argument("--source-home", type=Path, default=REPO / ".mm_assets")
    parser.add_argument("--out", type=Path, help="also write the results here (JSON)")
    args = parser.parse_args()
    source = args.source_home.resolve()
    if not (source / "speculators").is_dir():
        sys.exit(f"{source} holds no demo run: run `make demo` first (or --source-home)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="levers_") as workdir:
        env = bench_home(source, Path(workdir))
        for partition in args.partitions:
            for name in args.levers:
                rows.append(run_lever(env, name, partition, source))
                print(json.dumps(rows[-1]), flush=True)
                if args.out:
                    args.out.write_text(json.dumps(rows, indent=1))
    command = "python -m bench.training_levers " + " ".join(sys.argv[1:])
    print(f"\n`{command}` on {platform.node()} ({os.cpu_count()} CPUs)\n")
    print(markdown(rows))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
