"""`speculator_benchmark` end to end on the real CPU engine: the demo benchmark (TRL's
layout, images inside the Parquet file) prepared as a benchmark partition, a trained
draft measured on it per category beside no speculation and n-gram, the rows in the
`speculator_benchmarks` table, and a rerun that sends nothing."""

from __future__ import annotations

import dagster as dg
import pytest

from tests.conftest import materialize
from tests.test_speculator import PARTITION, _train

pytestmark = pytest.mark.slow
BENCHMARK = "demo_benchmark"
CONFIG = {"max_tokens": 32, "max_prompts_per_category": 2}


def _benchmark(**overrides) -> dict:
    result = materialize(
        PARTITION,
        ["speculator_benchmark"],
        run_config={"ops": {"speculator_benchmark": {"config": {**CONFIG, **overrides}}}},
    )
    (mat,) = result.asset_materializations_for_node("speculator_benchmark")
    return {k: v.value for k, v in mat.metadata.items()}


@pytest.fixture(scope="module")
def benchmarked(onpolicy_hidden_states) -> dict:
    _train(epochs=1, measure_in_vllm=False)  # the checkpoint test_speculator ends with
    prepared = materialize(
        BENCHMARK, ["raw_dataset", "coco_image_availability", "normalized_conversations"]
    )
    (normalized,) = prepared.asset_materializations_for_node("normalized_conversations")
    assert normalized.metadata["quarantined"].value == 0
    return _benchmark()


def _rows() -> list[dict]:
    from mm_assets.assets.resources import StorageResource

    with StorageResource().tables().connect() as con:
        cursor = con.execute(
            "SELECT * FROM speculator_benchmarks WHERE dataset = ? ORDER BY category, method",
            [PARTITION],
        )
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def test_every_category_and_method_is_measured_from_vllms_counters(benchmarked: dict) -> None:
    rows = _rows()
    categories = {r["category"] for r in rows}
    assert categories == {
        "describe_image", "image_follow_up", "arithmetic", "shapes_and_words", "overall",
    }  # fmt: skip
    assert {(r["category"], r["method"]) for r in rows} == {
        (c, m) for c in categories for m in ("none", "ngram", "eagle3")
    }
    for row in rows:
        assert row["status"] == "ok" and row["benchmark"] == BENCHMARK
        assert row["output_tokens"] > 0 and row["output_tokens_per_s"] > 0
        assert row["time_per_output_token_ms"] > 0
        if row["method"] == "none":
            assert row["acceptance_length"] is None and row["speedup"] == pytest.approx(1.0)
        else:  # the same prompts, greedy: the outputs equal no speculation's
            assert row["lossless"] == row["compared"] == row["requests"] > 0
            # n-gram proposes nothing where a reply repeats nothing of its prompt
            assert (row["acceptance_length"] is None) == (row["drafts"] == 0)
            assert row["drafts"] > 0 or row["method"] == "ngram"
            assert row["drafts"] == 0 or row["acceptance_length"] >= 1.0
    follow_up = {r["method"]: r for r in rows if r["category"] == "image_follow_up"}
    assert follow_up["none"]["requests"] == 2 * follow_up["none"]["prompts"]  # two turns
    overall = {r["method"]: r for r in rows if r["category"] == "overall"}
    per_category = [r for r in rows if r["category"] != "overall" and r["method"] == "eagle3"]
    drafts = sum(r["drafts"] for r in per_category)
    weighted = sum(r["acceptance_length"] * r["drafts"] for r in per_category) / drafts
    assert overall["eagle3"]["drafts"] == drafts
    assert overall["eagle3"]["acceptance_length"] == pytest.approx(weighted)
    assert benchmarked[f"benchmark_{BENCHMARK}_acceptance_length_eagle3"] == pytest.approx(
        overall["eagle3"]["acceptance_length"], rel=1e-3
    )
    assert "| **overall** |" in benchmarked[f"benchmark_{BENCHMARK}"]
    assert benchmarked[f"benchmark_{BENCHMARK}_plot"].startswith("![")


def test_a_rerun_sends_nothing_and_keeps_one_set_of_rows(benchmarked: dict) -> None:
    before = _rows()
    again = _benchmark()
    assert again[f"benchmark_{BENCHMARK}_reused"] is True and again["rows_written"] == 0
    after = _rows()
    assert len(after) == len(before)
    assert {r["measured_at"] for r in after} == {r["measured_at"] for r in before}
    key = lambda r: (r["category"], r["method"])  # noqa: E731
    assert {key(r): r["acceptance_length"] for r in after} == {
        key(r): r["acceptance_length"] for r in before
    }


def test_a_benchmark_partition_is_prepared_but_never_trained(benchmarked: dict) -> None:
    result = materialize(BENCHMARK, ["target_responses", "tokenized_samples", "trained_speculator"])
    for asset in ("target_responses", "tokenized_samples", "trained_speculator"):
        (mat,) = result.asset_materializations_for_node(asset)
        assert "never trained on" in mat.metadata["benchmark"].value
    checks = result.get_asset_check_evaluations()
    assert checks and all(c.passed for c in checks)
    assert isinstance(result, dg.ExecuteInProcessResult)
