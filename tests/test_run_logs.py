"""mm_assets logs through module loggers; the committed instance config (dagster.yaml,
`python_logs`) is what brings their lines into a run's log, where `context.log` used to."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import yaml

from mm_assets.registry import DatasetSpec
from mm_assets.services.ingest import load_rows
from tests.test_sources import KeptRows

REPO = Path(__file__).resolve().parents[1]


def test_a_line_a_service_logs_lands_in_the_run_log(tmp_path: Path) -> None:
    source = tmp_path / "tiny.jsonl"
    source.write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n')
    spec = DatasetSpec(name="tiny", format="sharegpt", path=str(source), max_samples=2)

    @dg.asset
    def tiny_rows() -> None:
        load_rows(spec, KeptRows())

    committed = yaml.safe_load((REPO / "dagster.yaml").read_text())
    with dg.instance_for_test(overrides={"python_logs": committed["python_logs"]}) as instance:
        result = dg.materialize([tiny_rows], instance=instance)
        logged = [
            entry
            for entry in instance.all_logs(result.run_id)
            if entry.user_message.startswith("tiny: 3 rows in")
        ]
    assert len(logged) == 1
    assert logged[0].user_message.endswith("3 after the filter, 2 kept")
    assert logged[0].step_key == "tiny_rows"
