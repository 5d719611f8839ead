"""Chaos run: kill the `*trained_speculator` chain of a demo partition at random points,
rerun it, and check that nothing was lost, duplicated or left behind.

The chain runs once cleanly, through the CLI (`dagster asset materialize`), in its own
storage root. Then, for each of `--points` kills (seeded), it runs again from scratch in
a fresh root and is killed with SIGKILL:
- at a named crash point (`mm_assets/common/crashpoints.py`): during a Parquet write,
  between a file's write and its rename (tables, blobs, records, checkpoints), after a
  training epoch's state is saved, during the vLLM measurement — the process alone, or
  its whole process group; the n-th time the point is reached, n drawn from the clean
  run's own count;
- at a random moment: the whole run's process group, or the vLLM server alone.
A normal rerun follows each kill. Then, against the clean run:
- every prep table is equal (the rows and their order);
- the hidden-state manifest has the same rows and keys, no row twice, and every blob
  decodes to the clean run's states within the engine's batch tolerance;
- no temporary file, no leftover incoming directory, no blob nothing references;
- the checkpoint loads through vLLM's speculators config reader, with the clean
  checkpoint's tensor names and shapes;
- no process of the killed run outlives it (a vLLM server, its EngineCore): none has its
  working directory, command line or open files in the run's root.

`.venv/bin/python -m bench.chaos --points 20 --seed 0` (`make chaos`); a few minutes per
point on 2 cores. Prints a Markdown report for BENCHMARKS.md, then the results as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mm_assets.common.crashpoints import POINTS

PARTITION = "demo_sharegpt"
REPO = Path(__file__).resolve().parent.parent
TIMED = ("group", "server")
PREP_TABLES = (
    "raw_dataset", "coco_image_availability", "normalized_conversations",
    "normalized_conversations_quarantine", "target_responses", "target_responses_quarantine",
    "tokenized_samples", "tokenized_samples_quarantine", "token_frequencies",
)  # fmt: skip
RUN_CONFIG = """
ops:
  target_responses: {config: {max_tokens: 64}}
  trained_speculator:
    config: {learning_rate: 0.003, batch_tokens: 512, measure_untrained_in_vllm: false}
"""
TEMPORARY = re.compile(r"^\..+\.\d+(@[0-9a-f]{8})?-[0-9a-f]{32}\.(tmp|old)$")
BLOB_TOLERANCE = 1e-3  # relative to a row's largest value: CPU batches differ in rounding


@dataclass(frozen=True)
class Chain:
    """What a chaos run materializes: the chain up to `select`, for one partition, with
    the datasets of `datasets` (a registry file; None: the built-in one)."""

    partition: str = PARTITION
    select: str = "*trained_speculator"
    run_config: str = RUN_CONFIG
    datasets: Path | None = None


@dataclass
class Kill:
    kind: str  # a crash point, or "group" / "server" (a timed kill)
    nth: int = 0  # the crash point's n-th time
    group: bool = False  # the crash point kills the whole process group
    after_s: float = 0.0  # timed kills

    def label(self) -> str:
        if self.kind in TIMED:
            return f"{self.kind} at {self.after_s:.0f}s"
        return f"{self.kind} #{self.nth}" + (" (group)" if self.group else "")


@dataclass
class Outcome:
    kill: str
    killed: bool
    rerun_ok: bool
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def survived(self) -> bool:
        return self.rerun_ok and not self.problems


def _env(root: Path, demo: Path, chain: Chain, extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MM_ASSETS_CRASH")}
    env.update(MM_ASSETS_HOME=str(root), DAGSTER_HOME=str(root / "dagster_home"))
    env.pop("MM_ASSETS_DATASETS", None)
    if chain.datasets is not None:
        env["MM_ASSETS_DATASETS"] = str(chain.datasets)
    (root / "dagster_home").mkdir(parents=True, exist_ok=True)
    instance = root / "dagster_home" / "dagster.yaml"
    if not instance.exists():  # the repo's: the accelerator pool's limit, run monitoring
        shutil.copyfile(REPO / "dagster.yaml", instance)
    if not (root / "demo").exists():
        (root / "demo").symlink_to(demo)
    return {**env, **(extra or {})}


def start(
    root: Path, demo: Path, chain: Chain, extra: dict[str, str] | None = None
) -> subprocess.Popen:
    """The chain through the CLI, in its own session (a kill of its group spares us)."""
    config = root / "run_config.yaml"
    config.write_text(chain.run_config)
    command = [
        str(Path(sys.executable).parent / "dagster"), "asset", "materialize",
        "-m", "mm_assets.definitions", "--select", chain.select,
        "--partition", chain.partition, "-c", str(config),
    ]  # fmt: skip
    log = open(root / "run.log", "ab")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        command, env=_env(root, demo, chain, extra), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def _servers_of(pid: int) -> list[Any]:
    """The guarded vLLM servers the run with this pid started (they run in their own
    session, under `parent_guard <pid>`)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "mm_assets.clients.parent_guard" in cmd and cmd[
            cmd.index("mm_assets.clients.parent_guard") + 1
        ] == str(pid):
            found.extend(proc.children())
    return found


def run_killed(root: Path, demo: Path, chain: Chain, kill: Kill) -> bool:
    """Run the chain with `kill`: whether it was killed (not: it ended first)."""
    extra = {}
    if kill.kind in POINTS:
        scope = ":group" if kill.group else ""
        extra["MM_ASSETS_CRASH_AT"] = f"{kill.kind}:{kill.nth}{scope}"
    run = start(root, demo, chain, extra)
    if kill.kind in TIMED:
        deadline = time.monotonic() + kill.after_s
        while run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        while run.poll() is None:
            if kill.kind == "group":
                os.killpg(run.pid, signal.SIGKILL)
                break
            servers = _servers_of(run.pid)
            if servers:
                for server in servers:
                    server.kill()
                break
            time.sleep(0.2)
    code = run.wait()
    return code == -signal.SIGKILL or (kill.kind == "server" and code != 0)


def processes_in(root: Path) -> list[str]:
    """Live processes, but this one, whose working directory, command line or open files
    lie under `root`: what a run kept there still runs (a server holds its log open, and
    vLLM's EngineCore inherits it)."""
    import psutil

    roots = {str(root), str(root.resolve())}
    inside = tuple(f"{r}{os.sep}" for r in roots)
    found = []
    for proc in psutil.process_iter(["cwd", "cmdline", "open_files", "status"]):
        info = proc.info
        if proc.pid == os.getpid() or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        files = [f.path for f in info["open_files"] or []]
        paths = [info["cwd"] or "", *(info["cmdline"] or []), *files]
        # `in`: an argument may hold a path inside JSON (the connector's directory)
        if any(p in roots or any(i in p for i in inside) for p in paths):
            found.append(f"pid {proc.pid} ({' '.join(info['cmdline'] or [])[:80]})")
    return found


def leftover_processes(root: Path, wait_s: float = 30.0) -> list[str]:
    """What a killed run in `root` still runs after `wait_s`: nothing, once a server's
    guard has ended its group (its grace is 10 s)."""
    deadline = time.monotonic() + wait_s
    while (left := processes_in(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


# -- checks ------------------------------------------------------------------------------


def _tables(root: Path, object_store: str | None = None) -> Any:
    from mm_assets.storage import open_tables

    return open_tables(root, object_store)


def _table_problems(
    root: Path, clean: Path, partition: str, object_store: str | None = None
) -> list[str]:
    problems = []
    got, want = _tables(root, object_store), _tables(clean)
    for table in PREP_TABLES:
        a, b = got.read(table, partition), want.read(table, partition)
        if not a.equals(b):
            problems.append(f"{table}: {a.num_rows} rows differ from the clean run's {b.num_rows}")
    return problems


def _manifest(root: Path, partition: str, object_store: str | None = None) -> list[dict]:
    return list(_tables(root, object_store).iter_rows("hidden_states_manifest", partition))


def _blob_problems(
    root: Path, clean: Path, partition: str, object_store: str | None = None
) -> list[str]:
    import torch
    from safetensors.torch import load_file

    from mm_assets.domain.model.hidden_state_codec import decode

    got, want = _manifest(root, partition, object_store), _manifest(clean, partition)
    problems = []
    ids = Counter(r["row_id"] for r in got)
    if twice := [row_id for row_id, n in ids.items() if n > 1]:
        problems.append(f"manifest rows listed twice: {twice[:3]}")
    pairs = {(r["row_id"], r["blob_key"]) for r in got}
    if pairs != {(r["row_id"], r["blob_key"]) for r in want}:
        problems.append(
            f"manifest: {len(got)} rows, not the clean run's {len(want)} (or other keys)"
        )
    clean_paths = {r["blob_key"]: r["path"] for r in want}
    worst = 0.0
    for row in got:
        if row["blob_key"] not in clean_paths:
            continue
        paths = (root / row["path"], clean / clean_paths[row["blob_key"]])
        a, b = (decode(load_file(p), None) for p in paths)
        scale = b.aux.abs().amax().clamp_min(1e-12)
        diff = torch.maximum((a.aux - b.aux).abs().amax(), (a.final - b.final).abs().amax())
        worst = max(worst, float(diff / scale))
    if worst > BLOB_TOLERANCE:
        problems.append(f"blobs differ from the clean run's by up to {worst:.2e} of a row's max")
    referenced = {Path(r["path"]).name for r in got}
    stored = {p.name for p in (root / "blobs" / "hidden_states").glob("??/*.safetensors")}
    if orphans := stored - referenced:
        problems.append(f"{len(orphans)} hidden-state blobs no manifest row references")
    return problems


def _leftover_files(root: Path) -> list[str]:
    left = [
        str(p.relative_to(root))
        for top in (
            "tables",
            "staging",
            "blobs",
            "speculators",
            "untrained_speculators",
            "train_state",
        )
        for p in (root / top).rglob("*")
        if TEMPORARY.match(p.name)
    ]
    return [f"temporary files left: {left[:3]}"] if left else []


def _checkpoint_problems(root: Path, clean: Path, partition: str) -> list[str]:
    from safetensors import safe_open
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    def shapes(directory: Path) -> dict[str, tuple]:
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118

    directory = root / "speculators" / partition
    try:
        SpeculatorsConfig.from_pretrained(str(directory))
        if shapes(directory) != shapes(clean / "speculators" / partition):
            return ["checkpoint tensors differ in names or shapes from the clean run's"]
    except Exception as exc:  # any failure to load is the finding
        return [f"checkpoint does not load: {type(exc).__name__}: {exc}"]
    return []


def check(root: Path, clean: Path, partition: str, object_store: str | None = None) -> list[str]:
    """Everything a rerun after a kill must share with the clean run (module docstring);
    with `object_store`, the run under `root` kept its tables there."""
    return [
        *_table_problems(root, clean, partition, object_store),
        *_blob_problems(root, clean, partition, object_store),
        *_leftover_files(root), *_checkpoint_problems(root, clean, partition),
    ]  # fmt: skip


# -- the run -----------------------------------------------------------------------------


def _kills(points: int, seed: int, reached: Counter[str], clean_s: float) -> list[Kill]:
    """`points` kills cycling through every kind, each drawn with the seed."""
    rng = random.Random(seed)
    kinds = [k for k in POINTS if reached[k]] + list(TIMED)
    kills = []
    for i in range(points):
        kind = kinds[i % len(kinds)]
        if kind in TIMED:
            kills.append(Kill(kind, after_s=rng.uniform(3.0, 0.9 * clean_s)))
        else:
            kills.append(Kill(kind, nth=rng.randint(1, reached[kind]), group=rng.random() < 0.3))
    return kills


def clean_run(home: Path, demo: Path, chain: Chain) -> tuple[Path, float, Counter[str]]:
    """The chain without a kill: its root, seconds, and how often each point was reached."""
    clean = home / "clean"
    shutil.rmtree(clean, ignore_errors=True)
    clean.mkdir(parents=True)
    started = time.perf_counter()
    log = clean / "crash_points.log"
    if start(clean, demo, chain, {"MM_ASSETS_CRASH_LOG": str(log)}).wait() != 0:
        raise RuntimeError(f"the clean run failed; see {clean / 'run.log'}")
    return clean, time.perf_counter() - started, Counter(log.read_text().split())


def survive(home: Path, demo: Path, chain: Chain, clean: Path, name: str, kill: Kill) -> Outcome:
    """One kill in a fresh root, the rerun, and the checks against the clean run."""
    root = home / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    began = time.perf_counter()
    killed = run_killed(root, demo, chain, kill)
    outcome = Outcome(kill.label(), killed, rerun_ok=False)
    if left := leftover_processes(root):
        outcome.problems.append(f"{len(left)} process(es) outlived the killed run: {left[:3]}")
    outcome.rerun_ok = start(root, demo, chain).wait() == 0
    if outcome.rerun_ok:
        outcome.problems += check(root, clean, chain.partition)
    else:
        outcome.problems.append(f"the rerun failed; see {root / 'run.log'}")
    outcome.seconds = time.perf_counter() - began
    return outcome


def run(points: int, seed: int, home: Path, keep: bool = False) -> dict[str, Any]:
    from mm_assets.demo.__main__ import build

    demo, chain = build(home / "demo"), Chain()
    clean, clean_s, reached = clean_run(home, demo, chain)
    outcomes = []
    for i, kill in enumerate(_kills(points, seed, reached, clean_s)):
        outcome = survive(home, demo, chain, clean, f"point_{i:02d}", kill)
        print(f"chaos: {i + 1}/{points} {outcome.kill}: killed={outcome.killed} "
              f"survived={outcome.survived} {outcome.problems}", flush=True)  # fmt: skip
        outcomes.append(outcome)
        if not keep and outcome.survived:
            shutil.rmtree(home / f"point_{i:02d}", ignore_errors=True)
    return {
        "partition": chain.partition, "seed": seed, "clean_run_s": round(clean_s, 1),
        "crash_points_reached": dict(reached),
        "outcomes": [asdict(o) | {"survived": o.survived} for o in outcomes],
    }  # fmt: skip


def markdown(results: dict, command: str) -> str:
    outcomes = results["outcomes"]
    killed = sum(o["killed"] for o in outcomes)
    survived = sum(o["survived"] for o in outcomes)
    lines = [
        f"Measured {datetime.date.today().isoformat()}; `{command}`. Partition "
        f"`{results['partition']}`, clean run {results['clean_run_s']} s; crash points "
        f"reached in it: {results['crash_points_reached']}.",
        "",
        "| # | kill | killed | rerun | problems |",
        "|---:|---|---|---|---|",
    ]
    for i, o in enumerate(outcomes, 1):
        problems = "; ".join(o["problems"]) or "none"
        lines.append(f"| {i} | {o['kill']} | {o['killed']} | {o['rerun_ok']} | {problems} |")
    lines += ["", f"Kill points tried: {len(outcomes)}, killed the run: {killed}, "
              f"survived with nothing lost: {survived}."]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--home", type=Path, default=None, help="default: a temporary dir")
    parser.add_argument("--keep", action="store_true", help="keep the roots that survived")
    args = parser.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="mm_assets_chaos_"))
    results = run(args.points, args.seed, home.resolve(), args.keep)
    print(
        markdown(
            results, f".venv/bin/python -m bench.chaos --points {args.points} --seed {args.seed}"
        )
    )
    print(json.dumps(results, indent=2))
    if not all(o["survived"] for o in results["outcomes"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
