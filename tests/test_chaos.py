"""A small chaos run (`bench/chaos.py` runs the large one, `make chaos`): the text chain
is killed with SIGKILL three times in a row in one storage root — during a Parquet write,
between a file's write and its rename (the whole process group, vLLM server included),
between two training epochs' saved states — each time resumed by the next run; the last
run must equal a clean one, with nothing lost, duplicated or left behind, and after each
kill no process with files in the run's root is left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos import Kill, check, leftover_processes, run_killed, start


@pytest.mark.slow
@pytest.mark.long
def test_three_kills_on_the_text_chain_lose_nothing(
    clean_text_chain, demo_dir: Path, tmp_path: Path
) -> None:
    chain, clean, reached = clean_text_chain
    assert reached["table_write"] and reached["before_rename"] and reached["after_epoch"] == 3
    root = tmp_path / "killed"
    root.mkdir()
    for kill in (
        Kill("table_write", nth=(reached["table_write"] + 1) // 2),
        Kill("before_rename", nth=reached["before_rename"] // 2, group=True),
        Kill("after_epoch", nth=2),
    ):
        assert run_killed(root, demo_dir, chain, kill), f"{kill.label()} was not reached"
        assert leftover_processes(root) == []  # nothing of the killed run runs on
    assert start(root, demo_dir, chain).wait() == 0
    assert check(root, clean, chain.partition) == []


def test_a_process_left_with_files_in_a_runs_root_is_found(tmp_path: Path) -> None:
    """What the chaos run counts as left behind: a process (as vLLM's EngineCore) holding
    the server's log open, working there, or naming the root inside a JSON argument."""
    root, logs = tmp_path / "point_00", tmp_path / "point_00" / "logs"
    logs.mkdir(parents=True)
    elsewhere = tmp_path / "point_001"
    elsewhere.mkdir()
    with open(logs / "server.log", "ab") as log:
        holder = subprocess.Popen(["sleep", "60"], stdout=log)
    working = subprocess.Popen(["sleep", "60"], cwd=root)
    sleeps = [sys.executable, "-c", "import time; time.sleep(60)"]
    naming = subprocess.Popen([*sleeps, json.dumps({"path": f"{root}/x"})])
    unrelated = subprocess.Popen(["sleep", "60"], cwd=elsewhere)
    try:
        left = leftover_processes(root, wait_s=0)
        assert {int(line.split()[1]) for line in left} == {holder.pid, working.pid, naming.pid}
    finally:
        for process in (holder, working, naming, unrelated):
            process.kill()
            process.wait()
    assert leftover_processes(root, wait_s=5) == []
