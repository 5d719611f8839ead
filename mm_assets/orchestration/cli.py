"""`python -m mm_assets.orchestration release RUN_ID`: free the pool slots of a run whose
worker died where the watch cannot tell (another machine, nothing recorded). Run on the
machine its worker ran on, it first stops what that dead worker left running there."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import dagster as dg

from mm_assets.common import paths
from mm_assets.orchestration.dead_runs import Verdict, judge, release
from mm_assets.orchestration.processes import stop_processes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mm_assets.orchestration",
        description="Free the pool slots a run holds (its worker died). Uses $DAGSTER_HOME.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("release", help="mark the run failed if unfinished; free its slots")
    cmd.add_argument("run_id")
    cmd.add_argument("--force", action="store_true", help="even if its worker is alive here")
    args = parser.parse_args(argv)
    paths.ensure_dagster_home()
    instance = dg.DagsterInstance.get()
    verdict = judge(instance, args.run_id)
    if verdict.action == "stop":  # its worker is gone from here: what it left goes too
        print(f"run {args.run_id}: {verdict.reason}. Stopping them.", file=sys.stderr)
        stop_processes(verdict.targets)
        verdict = judge(instance, args.run_id)
    if verdict.action in {"wait", "stop"} and not args.force:
        print(
            f"run {args.run_id}: {verdict.reason}. Stop it first (or pass --force to free "
            "the slot anyway).",
            file=sys.stderr,
        )
        return 1
    by_hand = Verdict("free", verdict.reason, mark_failed=True)
    release(instance, args.run_id, by_hand, "hand (python -m mm_assets.orchestration release)")
    print(f"run {args.run_id}: its slots are free ({verdict.reason})")
    return 0
