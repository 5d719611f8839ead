"""Cached reruns: automation asks only for what changed (evaluated without a daemon), and
the refresh schedule re-reads only datasets already loaded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import dagster as dg
import pytest

from mm_assets.assets.resources import StorageResource, VllmResource
from tests.conftest import SESSION_HOME

pytestmark = pytest.mark.slow
PARTITION = "auto_text"
CHAIN = [
    "raw_dataset", "coco_image_availability", "normalized_conversations", "target_responses",
    "tokenized_samples",
    "hidden_states", "trained_speculator",
]  # fmt: skip


def _requests(result: dg.EvaluateAutomationConditionsResult) -> dict[str, list[str]]:
    return {
        name: sorted(result.get_requested_partitions(dg.AssetKey(name)))
        for name in CHAIN
        if result.get_num_requested(dg.AssetKey(name))
    }


@pytest.fixture(scope="module")
def chain(demo_dir: Path, vllm_server, tmp_path_factory) -> dict:
    """The whole chain materialized for one text partition in a fresh instance + store."""
    from mm_assets.definitions import defs

    data = SESSION_HOME / "auto" / "sharegpt.jsonl"
    data.parent.mkdir(exist_ok=True)
    shutil.copyfile(demo_dir / "data" / "sharegpt.jsonl", data)
    resources = {
        **defs.resources,
        "storage": StorageResource(root=str(tmp_path_factory.mktemp("store"))),
        "vllm": VllmResource(base_urls=[vllm_server.base_url]),
    }
    instance = dg.DagsterInstance.local_temp(str(tmp_path_factory.mktemp("instance")))
    config = {"ops": {"trained_speculator": {"config": {"epochs": 1, "measure_in_vllm": False}}}}
    result = dg.materialize(
        [defs.get_assets_def(a) for a in CHAIN],
        partition_key=PARTITION,
        resources=resources,
        instance=instance,
        run_config=config,
    )
    assert result.success
    first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    return {
        "defs": defs,
        "instance": instance,
        "resources": resources,
        "data": data,
        "first": first,
    }


def _rerun_raw(chain: dict) -> None:
    dg.materialize(
        [chain["defs"].get_assets_def("raw_dataset")],
        partition_key=PARTITION,
        resources=chain["resources"],
        instance=chain["instance"],
    )


def test_nothing_is_requested_after_a_full_materialization(chain) -> None:
    assert _requests(chain["first"]) == {}


def test_code_version_bump_requests_that_stage_only(chain) -> None:
    """(Runs before the data edit below: both start from the same settled tick.)"""
    defs = chain["defs"]
    bumped = dg.Definitions(
        assets=dg.map_asset_specs(
            lambda spec: (
                spec.replace_attributes(code_version=f"{spec.code_version}+1")
                if spec.key == dg.AssetKey("tokenized_samples")
                else spec
            ),
            [defs.get_assets_def(a) for a in CHAIN],
        ),
        resources=defs.resources,
    )
    tick = dg.evaluate_automation_conditions(
        defs=bumped, instance=chain["instance"], cursor=chain["first"].cursor
    )
    assert _requests(tick) == {"tokenized_samples": [PARTITION]}


def test_identical_then_changed_data(chain) -> None:
    defs, instance = chain["defs"], chain["instance"]
    data: Path = chain["data"]
    os.utime(data)  # touched, same content: the schedule re-reads it
    _rerun_raw(chain)
    tick = dg.evaluate_automation_conditions(
        defs=defs, instance=instance, cursor=chain["first"].cursor
    )
    assert _requests(tick) == {}

    lines = data.read_text().splitlines()
    record = json.loads(lines[0])
    record["conversations"][-1]["value"] += " (edited)"
    lines[0] = json.dumps(record)
    data.write_text("\n".join(lines) + "\n")
    _rerun_raw(chain)
    tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
    # the partition's next stages (both read raw_dataset), nothing else, no other partition
    assert _requests(tick) == {
        "coco_image_availability": [PARTITION],
        "normalized_conversations": [PARTITION],
    }


def test_schedule_refreshes_only_loaded_datasets(chain) -> None:
    import datetime

    from mm_assets.assets.schedules import refresh_raw_datasets

    tick = datetime.datetime(2026, 12, 3, 3, 0, tzinfo=datetime.UTC)
    context = dg.build_schedule_context(instance=chain["instance"], scheduled_execution_time=tick)
    requests = refresh_raw_datasets(context)
    assert [r.partition_key for r in requests] == [PARTITION]
    assert requests[0].run_key == f"{PARTITION}:20261203T0300"
    assert refresh_raw_datasets.cron_schedule == "0 3 * * *"
