"""`speculator_benchmark` end to end on the real CPU engine: the demo benchmark (TRL's
layout, images inside the Parquet file) prepared as a benchmark partition, a trained
draft measured on it per category beside no speculation and n-gram, the rows in the
`speculator_benchmarks` table, and a rerun that sends nothing."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator

import pytest

from mm_assets.clients import warm_servers
from mm_assets.services.engine import KEEP_WARM_ENV
from tests.conftest import materialize
from tests.test_speculator import PARTITION, _train

pytestmark = pytest.mark.slow
BENCHMARK = "demo_benchmark"
DRAFT = "onpolicy_capped"  # the tests' registry: a draft of demo_onpolicy, capped
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
def benchmarked(onpolicy_hidden_states) -> Iterator[dict]:
    _train(epochs=1, measure_in_vllm=False)  # the checkpoint test_speculator ends with
    prepared, warned = _prepare(BENCHMARK)
    assert not warned
    _, warned = _prepare(BENCHMARK, "dataset_chain")  # the steps it skips warn
    assert len(warned) == 3, warned
    (normalized,) = prepared.asset_materializations_for_node("normalized_conversations")
    assert normalized.metadata["quarantined"].value == 0
    # the methods' servers are kept for a remeasure (the last test), as the demo keeps them
    with pytest.MonkeyPatch.context() as env:
        env.setenv(KEEP_WARM_ENV, "3")
        try:
            yield _benchmark()
        finally:
            warm_servers.stop_all()


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _prepare(partition: str, job: str = "prepare"):
    """A job on a benchmark's partition, as the demo runs `prepare`; returns its result
    and the warnings Dagster logged (`dataset_chain` skips the training steps there, and
    warns that their blocking checks gave no result)."""
    import dagster as dg

    from mm_assets.definitions import defs

    caught, dagster_log = _Warnings(), logging.getLogger("dagster")
    dagster_log.addHandler(caught)
    try:
        result = defs.resolve_job_def(job).execute_in_process(
            partition_key=partition, instance=dg.DagsterInstance.get()
        )
    finally:
        dagster_log.removeHandler(caught)
    assert result.success
    return result, [m for m in caught.messages if "Blocking asset check" in m]


def _rows(draft: str = PARTITION, table: str = "speculator_benchmarks") -> list[dict]:
    from mm_assets.assets.resources import StorageResource

    with StorageResource().tables().connect() as con:
        cursor = con.execute(
            f"SELECT * FROM {table} WHERE dataset = ? ORDER BY category, method", [draft]
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
        assert row["speculative_tokens"] == (None if row["method"] == "none" else 3)
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
        assert row["output_tokens_per_s_low"] <= row["output_tokens_per_s"]
        assert row["output_tokens_per_s"] <= row["output_tokens_per_s_high"], row
        if row["method"] != "none":  # paired with no speculation on the same prompts
            assert row["speedup_low"] <= row["speedup"] <= row["speedup_high"], row
        if row["drafts"]:
            assert row["acceptance_low"] <= row["acceptance_length"] <= row["acceptance_high"]
    requests = _rows(table="speculator_benchmark_prompts")  # what the figures sum
    beside = [r for r in requests if r["beside"] is not None]  # the speedups' pairs
    assert {r["beside"] for r in beside} == {"ngram@3", "eagle3@3"}
    assert {r["method"] for r in beside} == {"none"}
    requests = [r for r in requests if r["beside"] is None]
    assert len(beside) == 2 * len([r for r in requests if r["method"] == "none"])
    for row in rows:
        mine = [r for r in requests if r["method"] == row["method"]]
        mine = [r for r in mine if row["category"] in ("overall", r["category"])]
        assert len(mine) == row["requests"] and row["measurement"] == mine[0]["measurement"]
        assert sum(r["output_tokens"] for r in mine) == row["output_tokens"]
        assert sum(r["drafts"] for r in mine) == row["drafts"]
    follow_up = {r["method"]: r for r in rows if r["category"] == "image_follow_up"}
    assert follow_up["none"]["requests"] == 2 * follow_up["none"]["prompts"]  # two turns
    overall = {r["method"]: r for r in rows if r["category"] == "overall"}
    per_category = [r for r in rows if r["category"] != "overall" and r["method"] == "eagle3"]
    drafts = sum(r["drafts"] for r in per_category)
    weighted = sum(r["acceptance_length"] * r["drafts"] for r in per_category) / drafts
    assert overall["eagle3"]["drafts"] == drafts
    assert overall["eagle3"]["acceptance_length"] == pytest.approx(weighted)
    assert benchmarked[f"{BENCHMARK} eagle3 acceptance"] == pytest.approx(
        overall["eagle3"]["acceptance_length"], rel=1e-3
    )
    table = benchmarked[BENCHMARK]  # Dagster's own table metadata
    shown = {(r.data["category"], r.data["method"]) for r in table.records}
    assert ("overall", "draft (EAGLE-3)") in shown and len(shown) == len(rows)
    draft_overall = next(
        r.data
        for r in table.records
        if r.data["method"] == "draft (EAGLE-3)" and r.data["category"] == "overall"
    )
    assert draft_overall["prompts"] == overall["eagle3"]["prompts"]
    assert draft_overall["acceptance 95% CI"].startswith("[")
    versus = benchmarked[f"{BENCHMARK} draft vs n-gram"].records  # paired, per category
    assert {r.data["category"] for r in versus} == categories
    assert benchmarked[f"{BENCHMARK} plot"].startswith("![")
    assert max(len(key) for key in benchmarked) <= 40  # the UI's key column


def test_a_rerun_sends_nothing_and_keeps_one_set_of_rows(benchmarked: dict) -> None:
    before = _rows()
    again = _benchmark()
    assert again["reused"] is True and again["rows_written"] == 0
    after = _rows()
    assert len(after) == len(before)
    assert {r["measured_at"] for r in after} == {r["measured_at"] for r in before}
    key = lambda r: (r["category"], r["method"])  # noqa: E731
    assert {key(r): r["acceptance_length"] for r in after} == {
        key(r): r["acceptance_length"] for r in before
    }


def test_a_draft_of_several_datasets_is_benchmarked_through_the_same_path(
    benchmarked: dict,
) -> None:
    """`draft_benchmark` (the draft partitions) on its sources' benchmark, with its
    entry's settings (max_tokens) and the launched ones: the dataset's checkpoint under
    the draft's name is the same draft on the same prompts, so every figure is the
    recorded one (no server starts) and the rows are written under the draft's name."""
    from mm_assets.assets.resources import StorageResource

    root = StorageResource().root_dir() / "speculators"
    shutil.copytree(root / PARTITION, root / DRAFT, dirs_exist_ok=True)
    launched = {k: v for k, v in CONFIG.items() if k != "max_tokens"}  # the entry sets it
    result = materialize(
        DRAFT, ["draft_benchmark"], run_config={"ops": {"draft_benchmark": {"config": launched}}}
    )
    (mat,) = result.asset_materializations_for_node("draft_benchmark")
    assert mat.metadata["reused"].value is True
    figures = lambda r: (r["category"], r["method"], r["acceptance_length"], r["lossless"])  # noqa: E731
    mine, dataset = _rows(DRAFT), _rows()
    assert {r["draft"] for r in mine} == {DRAFT} and {r["max_tokens"] for r in mine} == {32}
    assert sorted(map(figures, mine), key=str) == sorted(map(figures, dataset), key=str)


def test_the_demo_prints_each_draft_against_n_gram_and_the_drafts_against_each_other(
    benchmarked: dict,
) -> None:
    """`make demo`'s benchmark table, read from the tables: per category with intervals,
    then each draft against n-gram and each pair of drafts, paired on the same prompts.
    The two drafts here are one checkpoint on the same recorded prompts, so their ratio
    is exactly 1 (a pairing that lost the prompts would print nothing)."""
    from mm_assets.demo.__main__ import _benchmark_table

    printed = _benchmark_table((PARTITION, DRAFT), BENCHMARK).splitlines()
    overall = [line for line in printed if " overall " in line]
    assert len(overall) == 2 and all(line.count("[") == 2 for line in overall)
    against_ngram = [line for line in printed if "against n-gram on the same 8 prompts" in line]
    assert len(against_ngram) == 2 and all("acceptance" in line for line in against_ngram)
    (pair,) = [line for line in printed if f"{PARTITION} against {DRAFT}" in line]
    assert "on the same 8 prompts: acceptance 1.00x [1.00, 1.00]" in pair
    assert "tokens/s 1.00x [1.00, 1.00]" in pair


def test_a_benchmark_partition_is_prepared_but_never_trained(benchmarked: dict) -> None:
    """The training stages materialize nothing on a benchmark's partition (the UI shows
    the partition missing, with an observation saying why) and the steps below them in
    the run are skipped, not run."""
    stages = ["target_responses", "tokenized_samples", "trained_speculator"]
    result = materialize(BENCHMARK, stages)
    assert result.success
    assert all(not result.asset_materializations_for_node(a) for a in stages)
    # tokenized_samples is below target_responses in this run: skipped; trained_speculator
    # is not (hidden_states is not in the run), so it runs, and says why it does nothing
    skipped = {e.step_key for e in result.all_events if e.event_type_value == "STEP_SKIPPED"}
    assert skipped == {"tokenized_samples"}
    for ran in ("target_responses", "trained_speculator"):
        (observed,) = result.asset_observations_for_node(ran)
        assert "never trained on" in observed.metadata["benchmark"].value
    assert not result.get_asset_check_evaluations()


def test_a_remeasure_takes_over_the_servers_the_first_measurement_kept_warm(
    benchmarked: dict,
) -> None:
    """With `keep_warm`, the servers of no speculation, n-gram and the draft are parked
    when the benchmark ends; a remeasure takes each over (no server of its own, no log of
    its own) and measures the same: greedy, lossless, the same acceptance."""
    from mm_assets.assets.resources import StorageResource

    kept = {server.process.pid for server in warm_servers.parked()}
    assert len(kept) == 3
    before = {(r["category"], r["method"]): r for r in _rows()}
    config = {**CONFIG, "remeasure": True}
    result = materialize(
        PARTITION,
        ["speculator_benchmark"],
        run_config={"ops": {"speculator_benchmark": {"config": config}}},
    )
    logs = StorageResource().root_dir() / "logs"
    assert not list(logs.glob(f"vllm_bench_*{result.run_id}*"))
    assert {server.process.pid for server in warm_servers.parked()} == kept
    after = {(r["category"], r["method"]): r for r in _rows()}
    assert after.keys() == before.keys()
    for key, row in after.items():
        assert row["measured_at"] > before[key]["measured_at"]
        assert row["acceptance_length"] == pytest.approx(before[key]["acceptance_length"])
        if key[1] != "none":
            assert row["lossless"] == row["compared"] > 0
