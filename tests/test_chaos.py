"""A small chaos run (`bench/chaos.py` runs the large one, `make chaos`): the text chain
is killed with SIGKILL three times in a row in one storage root — during a Parquet write,
between a file's write and its rename (the whole process group, vLLM server included),
between two training epochs' saved states — each time resumed by the next run; the last
run must equal a clean one, with nothing lost, duplicated or left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import Kill, check, leftover_servers, run_killed, start


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
        killed, pid = run_killed(root, demo_dir, chain, kill)
        assert killed, f"{kill.label()} was not reached"
        assert leftover_servers(pid) == 0
    assert start(root, demo_dir, chain).wait() == 0
    assert check(root, clean, chain.partition) == []
