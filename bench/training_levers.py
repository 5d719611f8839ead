"""Each training lever against today's recipe, measured in vLLM on both demo partitions,
over several seeds, with paired 95% intervals.

From a home where `make demo` ran (`--source-home`: its tables and stored hidden states,
read in place, and its drafts as warm-start points), each lever retrains a partition's
draft under each seed with `dagster asset materialize --select trained_speculator` and
the registry's demo settings plus the lever's, and vLLM measures it on the held-out
prompts. The held-out split is fixed (`split_seed: 0`), so every run is measured on the
same prompts and a seed changes only the initialisation, batch order and noise.

A lever is judged against today's recipe under the same seed, prompt by prompt: the
ratio of acceptance lengths over every (seed, prompt) pair, with a paired bootstrap
interval resampled within each seed (the prompts' noise), and the ratio under each seed
alone. Today's recipe under the other seeds against its first gives what a seed alone
moves (`seed_margin`, the seeds' noise). A lever **helps** when its interval lies above 1
and the mean of its per-seed ratios clears that margin, **hurts** on the mirror, and is
otherwise within the noise.

`speculators' recipe` is the peer comparison: speculators' trainer cannot run on CPU (its
device falls back to cuda:0), so its defaults run in this loop.

Prints a Markdown block for BENCHMARKS.md, then the results as JSON.
`.venv/bin/python -m bench.training_levers [--partitions P ...] [--levers NAME ...]
[--seeds S ...] [--source-home DIR] [--out FILE]`
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
# the other draft family on the same states and prompts (its demo learning rate; blocks of
# today's depth, then blocks of 8 against EAGLE-3 at depth 7)
LEVERS["DFlash"] = {"draft": "dflash", "learning_rate": 3.0e-3}
LEVERS["P-EAGLE"] = {"draft": "peagle"}  # EAGLE-3 drafting all its tokens in one pass
DEPTH_7 = {"ttt_steps": 7, "speculative_tokens": 7}
LEVERS["DFlash, block 8"] = {"draft": "dflash", "learning_rate": 3.0e-3, **DEPTH_7}
LEVERS["EAGLE-3, depth 7"] = DEPTH_7
MEASURED = {"measure_in_vllm": True, "measure_untrained_in_vllm": False, "split_seed": 0}
SEEDS = (0, 1, 2)
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


def lever_config(name: str, partition: str, source: Path, seed: int) -> dict[str, Any]:
    settings = {**MEASURED, **LEVERS[name], "seed": seed}
    if name.startswith("warm start"):
        settings["init_from"] = str(source / "speculators" / WARM_FROM[partition])
    return {"ops": {"trained_speculator": {"config": settings}}}


def per_prompt(home: Path, partition: str) -> dict[str, tuple[int, int]]:
    """(drafts, accepted) of each held-out prompt the trained draft was measured on, by
    the prompt's JSON, from the measurement's record."""
    from mm_assets.services.measurement import measurement_record

    record = json.loads(measurement_record(home, partition, partition).read_text())
    return {
        json.dumps(prompt, sort_keys=True): (drafts, accepted)
        for group in record["payload"].values()
        for prompt, (drafts, accepted) in zip(group["prompts"], group["per_prompt"], strict=True)
    }


def run_lever(
    env: dict[str, str], name: str, partition: str, source: Path, seed: int
) -> dict[str, Any]:
    import dagster as dg

    config = lever_config(name, partition, source, seed)
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
    prompts = per_prompt(Path(env["MM_ASSETS_HOME"]), partition)
    return row | {"lever": name, "partition": partition, "seed": seed, "per_prompt": prompts,
                  "wall_s": round(wall, 1), "step_s": round(sum(seconds.values()), 1)}  # fmt: skip


def _pairs(
    runs: list[dict[str, Any]], base: list[dict[str, Any]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int]]:
    """The (drafts, accepted) of `runs` and of `base` on the prompts both measured, seed by
    seed (a run pairs with the base run of its seed), and each pair's seed."""
    ours, theirs, seeds = [], [], []
    for run in runs:
        (other,) = [b for b in base if b["seed"] == run["seed"]]
        for prompt in sorted(run["per_prompt"].keys() & other["per_prompt"].keys()):
            ours.append(run["per_prompt"][prompt])
            theirs.append(other["per_prompt"][prompt])
            seeds.append(run["seed"])
    return ours, theirs, seeds


def against(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """`runs` (a lever, one per seed) against `base` (today's, the same seeds): the paired
    ratio of acceptance lengths with its interval, and each seed's ratio."""
    from mm_assets.domain.model.intervals import paired_ratio_interval

    ours, theirs, seeds = _pairs(runs, base)
    counts = [tuple(zip(*side, strict=True)) for side in (ours, theirs)]
    a, b = ((accepted, drafts) for drafts, accepted in counts)
    found = paired_ratio_interval(a, b, offset=1.0, strata=seeds)
    by_seed = {}
    for seed in dict.fromkeys(seeds):
        mine = [i for i, s in enumerate(seeds) if s == seed]
        length = [1 + sum(side[i][1] for i in mine) / sum(side[i][0] for i in mine)
                  for side in (ours, theirs)]  # fmt: skip
        by_seed[seed] = round(length[0] / length[1], 4)
    interval = found and {"value": found.value, "low": found.low, "high": found.high}
    return {"ratio": interval, "n": len(seeds), "by_seed": by_seed}


def seed_margin(floor: dict[str, Any], seeds: int) -> float:
    """How far from 1 the mean of `seeds` per-seed ratios may fall by the seed alone: twice
    the spread of today's recipe under the other seeds against its first (the root mean
    square of their ratios' distance from 1), over √seeds."""
    spread = [r - 1 for r in floor["by_seed"].values()]
    return 2 * (sum(d * d for d in spread) / len(spread)) ** 0.5 / seeds**0.5


def verdict(found: dict[str, Any], margin: float) -> str:
    """helps: the paired interval over prompts lies above 1 and the per-seed ratios' mean
    clears the seed margin; hurts: the mirror; else within noise (of prompts or seeds)."""
    ratio, mean = found["ratio"], sum(found["by_seed"].values()) / len(found["by_seed"])
    if ratio and ratio["low"] > 1 and mean - 1 > margin:
        return "helps"
    if ratio and ratio["high"] < 1 and 1 - mean > margin:
        return "hurts"
    return "within noise"


def pooled(runs: list[dict[str, Any]]) -> dict[str, float] | None:
    """The acceptance length over every seed's prompts, with its interval (resampled
    within each seed)."""
    from mm_assets.domain.model.intervals import ratio_interval

    counts = [(d, a, r["seed"]) for r in runs for d, a in r["per_prompt"].values()]
    drafts, accepted, seeds = zip(*counts, strict=True)
    found = ratio_interval(accepted, drafts, offset=1.0, strata=seeds)
    return found and {"value": found.value, "low": found.low, "high": found.high, "n": found.n}


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per partition and lever: the pooled acceptance, and against today's recipe. For
    today itself: each later seed against the first, the floor a seed alone moves
    (`seed_margin`), which every lever's verdict must clear."""
    out = []
    for partition in dict.fromkeys(r["partition"] for r in rows):
        mine = [r for r in rows if r["partition"] == partition]
        today = [r for r in mine if r["lever"] == "today"]
        first = [dict(today[0], seed=r["seed"]) for r in today[1:]]
        floor = against(today[1:], first) if first else None
        for lever in dict.fromkeys(r["lever"] for r in mine):
            runs = [r for r in mine if r["lever"] == lever]
            found = {"partition": partition, "lever": lever, "acceptance": pooled(runs)}
            if lever == "today" and floor:
                margin = seed_margin(floor, len(today))
                found |= floor | {"verdict": f"seeds alone: margin ±{100 * margin:.1f}%"}
            elif today and floor:
                compared = against(runs, today)
                margin = seed_margin(floor, len(compared["by_seed"]))
                found |= compared | {"verdict": verdict(compared, margin)}
            out.append(found)
    return out


def _text(found: dict[str, float] | None) -> str:
    if not found:
        return "–"
    return f"{found['value']:.3f} [{found['low']:.3f}, {found['high']:.3f}]"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| partition | lever | vLLM acceptance (all seeds) | vs today (paired) | per seed | "
        "verdict |",
        "|---|---|---:|---:|---|---|",
    ]
    for v in verdicts(rows):
        seeds = ", ".join(f"{s}: {r:.3f}" for s, r in v.get("by_seed", {}).items())
        lines.append(
            f"| {v['partition']} | {v['lever']} | {_text(v['acceptance'])} "
            f"n={(v['acceptance'] or {}).get('n', 0)} | {_text(v.get('ratio'))} | {seeds} | "
            f"{v.get('verdict', '')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.training_levers")
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS))
    parser.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--source-home", type=Path, default=REPO / ".mm_assets")
    parser.add_argument("--out", type=Path, help="also write the results here (JSON)")
    args = parser.parse_args()
    source = args.source_home.resolve()
    if not (source / "speculators").is_dir():
        sys.exit(f"{source} holds no demo run: run `make demo` first (or --source-home)")
    levers = ["today", *(lever for lever in args.levers if lever != "today")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="levers_") as workdir:
        env = bench_home(source, Path(workdir))
        for partition in args.partitions:
            for name in levers:
                for seed in args.seeds:
                    rows.append(run_lever(env, name, partition, source, seed))
                    shown = {k: v for k, v in rows[-1].items() if k != "per_prompt"}
                    print(json.dumps(shown), flush=True)
                    if args.out:
                        args.out.write_text(json.dumps(rows, indent=1))
    command = "python -m bench.training_levers " + " ".join(sys.argv[1:])
    print(f"\n`{command}` on {platform.node()} ({os.cpu_count()} CPUs)\n")
    print(markdown(rows))
    print(json.dumps(verdicts(rows), indent=1))


if __name__ == "__main__":
    main()
