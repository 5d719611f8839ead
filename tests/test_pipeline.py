"""The four stages materialized through Dagster on real files, then queried with DuckDB."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import duckdb
import pytest

from mm_assets.clients.media_urls import file_url_path
from tests.bad_inputs import write_bad_inputs
from tests.conftest import PREP_ASSETS, materialize
from tests.plots import PLOT_SIZE, decode_plot


def _materialize(partition: str, raise_on_error: bool = True) -> dg.ExecuteInProcessResult:
    return materialize(partition, PREP_ASSETS, raise_on_error=raise_on_error)


def _metadata(result: dg.ExecuteInProcessResult, asset: str) -> dict:
    (mat,) = [m for m in result.asset_materializations_for_node(asset)]
    return {k: v.value for k, v in mat.metadata.items()}


@pytest.fixture(scope="module")
def demo_results(prepared_demo) -> dict[str, dg.ExecuteInProcessResult]:
    return prepared_demo


def test_demo_partitions_materialize_and_are_queryable(demo_results) -> None:
    from mm_assets.assets.resources import StorageResource

    assert all(r.success for r in demo_results.values())
    tables = StorageResource().tables()
    with tables.connect() as con:
        counts = dict(
            con.execute(
                "SELECT dataset, count(*) FROM tokenized_samples "
                "WHERE dataset LIKE 'demo_sharegpt%' GROUP BY ALL"
            ).fetchall()
        )
        normalized = dict(
            con.execute(
                "SELECT dataset, count(*) FROM normalized_conversations "
                "WHERE dataset LIKE 'demo_sharegpt%' GROUP BY ALL"
            ).fetchall()
        )
        missing = con.execute(
            "SELECT count(*) FROM coco_image_availability "
            "WHERE dataset = 'demo_sharegpt4v_coco' AND status = 'missing'"
        ).fetchone()[0]
        quarantined = con.execute(
            "SELECT reason, count(*) FROM normalized_conversations_quarantine "
            "WHERE dataset = 'demo_sharegpt4v_coco' GROUP BY ALL"
        ).fetchall()
        bad_masks = con.execute(
            "SELECT count(*) FROM tokenized_samples "
            "WHERE len(input_ids) != len(loss_mask) OR seq_len != len(input_ids) "
            "OR num_supervised != list_sum(loss_mask) OR num_supervised = 0"
        ).fetchone()[0]
        multimodal_messages = con.execute(
            "SELECT messages FROM tokenized_samples WHERE dataset = 'demo_sharegpt4v_coco' LIMIT 1"
        ).fetchone()[0]
        freq_total = con.execute(
            "SELECT sum(count) FROM token_frequencies WHERE dataset = 'demo_sharegpt'"
        ).fetchone()[0]
        supervised_total = con.execute(
            "SELECT sum(num_supervised) FROM tokenized_samples WHERE dataset = 'demo_sharegpt'"
        ).fetchone()[0]
    assert counts == normalized and counts["demo_sharegpt4v_coco"] > 150
    assert counts["demo_sharegpt"] > 50
    assert missing >= 3 and dict(quarantined)["image_unavailable"] == missing
    assert bad_masks == 0
    assert json.loads(multimodal_messages)[0]["role"] in {"system", "user"}
    assert freq_total == supervised_total


def test_multimodal_rows_carry_vllm_messages_with_file_urls(demo_results) -> None:
    from mm_assets.assets.resources import StorageResource

    rows = list(StorageResource().tables().iter_rows("tokenized_samples", "demo_sharegpt4v_coco"))
    multimodal = [r for r in rows if r["multimodal"]]
    assert multimodal and all(r["image_hashes"] for r in multimodal)
    urls = [
        part["image_url"]["url"]
        for r in multimodal
        for message in json.loads(r["messages"])
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] == "image_url"
    ]
    assert len(urls) == sum(len(r["image_hashes"]) for r in multimodal)
    assert all(u.startswith("file:///") and file_url_path(u).is_file() for u in urls)
    # each carries its probe's hash, which the client checks when it sends the file inline
    hashes = [h for r in multimodal for h in r["image_hashes"]]
    assert [u.partition("#sha256=")[2] for u in urls] == hashes


def test_metadata_a_user_reads(demo_results) -> None:
    result = demo_results["demo_sharegpt4v_coco"]
    images = _metadata(result, "coco_image_availability")
    assert "| missing |" in images["images_by_status"]
    normalized = _metadata(result, "normalized_conversations")
    assert "image_unavailable" in normalized["drop_reasons"]
    tokenized = _metadata(result, "tokenized_samples")
    assert 0 < tokenized["supervised_fraction"] < 1
    assert (
        "⟦" in tokenized["sample_with_loss_mask"]
        and "<image ×" in tokenized["sample_with_loss_mask"]
    )
    assert tokenized["tokens_max"] >= tokenized["tokens_p50"] > 0
    assert decode_plot(tokenized["token_lengths"]).size == PLOT_SIZE
    # the catalog path and the query shown beside every table work as printed
    sql = tokenized["query"].split("```sql\n")[1].split("\n```")[0]
    with duckdb.connect(tokenized["catalog"], read_only=True) as con:
        rows = con.execute(sql.replace("LIMIT 20", "")).fetchall()
    assert len(rows) == tokenized["rows"]
    checks = result.get_asset_check_evaluations()
    assert {(c.asset_key.to_user_string(), c.check_name, c.passed) for c in checks} == {
        ("raw_dataset", "has_rows", True),
        ("coco_image_availability", "image_availability_ratio", True),
        ("normalized_conversations", "has_rows", True),
        ("target_responses", "quarantine_ratio", True),
        ("tokenized_samples", "quarantine_ratio", True),
    }
    responses = _metadata(result, "target_responses")
    assert responses["responses"] == "dataset" and responses["rows"] == normalized["rows"]


# -- bad input -----------------------------------------------------------------------


def test_bad_inputs_are_quarantined_with_reasons_and_good_rows_kept(demo_dir: Path) -> None:
    from mm_assets.assets.resources import StorageResource

    expected, late = write_bad_inputs()
    assert len(expected) >= 30
    result = _materialize("bad_inputs")
    assert result.success
    tables = StorageResource().tables()
    kept = {r["source_index"] for r in tables.iter_rows("normalized_conversations", "bad_inputs")}
    quarantined = {
        r["source_index"]: r["reason"]
        for r in tables.iter_rows("normalized_conversations_quarantine", "bad_inputs")
    }
    assert kept == {i for i, reason in expected.items() if reason is None}
    assert quarantined == {i: reason for i, reason in expected.items() if reason is not None}
    statuses = {
        r["reference"]: r["status"]
        for r in tables.iter_rows("coco_image_availability", "bad_inputs")
    }
    assert statuses == {
        "coco/train2017/good.jpg": "ok",
        "coco/train2017/good2.png": "ok",
        "coco/train2017/nope.jpg": "missing",
        "coco/train2017/empty.jpg": "empty",
        "coco/train2017/cut.jpg": "unreadable",
        "coco/train2017/text.jpg": "unreadable",
        "coco/../outside.jpg": "outside_root",
        "coco/train2017/escape.jpg": "outside_root",
        "coco/train2017/bomb.png": "too_large",
        "coco/train2017/cmyk.jpg": "ok",
        "coco/train2017/gray.png": "ok",
        "coco/train2017/alpha.png": "ok",
        "/etc/hostname": "outside_root",
        "sam/images/sa_1.jpg": "missing",
        "http://example.com/a.jpg": "invalid_reference",
        "coco/train2017/folder.jpg": "unreadable",
        "12345": "missing",
    }
    tokenized = list(tables.iter_rows("tokenized_samples", "bad_inputs"))
    assert sorted(r["source_index"] for r in tokenized) == sorted(kept - set(late))
    dropped = tables.iter_rows("tokenized_samples_quarantine", "bad_inputs")
    assert {r["source_index"]: r["reason"] for r in dropped} == late


def _failed_check(result: dg.ExecuteInProcessResult, asset: str, name: str):
    (check,) = [
        c
        for c in result.get_asset_check_evaluations()
        if (c.asset_key.to_user_string(), c.check_name) == (asset, name)
    ]
    assert not check.passed
    return check


def test_an_empty_stage_fails_its_check_and_stops_downstream(demo_dir: Path) -> None:
    """An empty source, and a source whose every row is quarantined: the stage where the
    partition became empty fails its blocking check, saying what to look at."""
    from tests.conftest import SESSION_HOME

    edge = SESSION_HOME / "edge"
    edge.mkdir(exist_ok=True)
    (edge / "empty.jsonl").write_text("")
    bad = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]}]
    (edge / "all_bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad * 3))

    result = _materialize("empty_source", raise_on_error=False)
    check = _failed_check(result, "raw_dataset", "has_rows")
    assert "path (or hub id and split) and filter" in check.description
    assert not result.asset_materializations_for_node("normalized_conversations")

    result = _materialize("all_quarantined", raise_on_error=False)
    check = _failed_check(result, "normalized_conversations", "has_rows")
    assert "normalized_conversations_quarantine" in check.description
    assert not result.asset_materializations_for_node("tokenized_samples")


def test_a_mostly_quarantined_tokenization_fails_its_check(demo_dir: Path) -> None:
    """The bad-input corpus without the registry's allowance: 1 of the 8 conversations
    supervises only its end-of-turn marker, above the default 10%."""
    write_bad_inputs()
    result = _materialize("bad_inputs_strict", raise_on_error=False)
    check = _failed_check(result, "tokenized_samples", "quarantine_ratio")
    assert "1/8 conversations quarantined" in check.description
    assert "too_few_supervised_tokens: 1" in check.description
    assert check.metadata["quarantine_ratio"].value == pytest.approx(1 / 8, abs=1e-4)


def test_low_availability_fails_the_blocking_check_and_stops_downstream(demo_dir: Path) -> None:
    """The demo data with a wrong image root: the check names the fix, and nothing
    downstream of the availability stage runs."""
    result = _materialize("demo_wrong_root", raise_on_error=False)
    (check,) = [
        c
        for c in result.get_asset_check_evaluations()
        if c.check_name == "image_availability_ratio"
    ]
    assert not check.passed and "COCO_DIR" in check.description
    assert result.asset_materializations_for_node("coco_image_availability")
    assert not result.asset_materializations_for_node("normalized_conversations")
    assert not result.asset_materializations_for_node("tokenized_samples")
