"""The four stages materialized through Dagster on real files, then queried with DuckDB."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import dagster as dg
import pytest
from PIL import Image

from tests.conftest import BAD_DIR


def _materialize(partition: str) -> dg.ExecuteInProcessResult:
    from mm_assets.definitions import defs

    job = defs.resolve_implicit_global_asset_job_def()
    return job.execute_in_process(partition_key=partition, instance=dg.DagsterInstance.get())


def _metadata(result: dg.ExecuteInProcessResult, asset: str) -> dict:
    (mat,) = [m for m in result.asset_materializations_for_node(asset)]
    return {k: v.value for k, v in mat.metadata.items()}


@pytest.fixture(scope="module")
def demo_results(demo_dir: Path) -> dict[str, dg.ExecuteInProcessResult]:
    return {p: _materialize(p) for p in ("demo_sharegpt4v_coco", "demo_sharegpt")}


def test_demo_partitions_materialize_and_are_queryable(demo_results) -> None:
    from mm_assets.resources import StorageResource

    assert all(r.success for r in demo_results.values())
    tables = StorageResource().tables()
    with tables.connect() as con:
        counts = dict(
            con.execute("SELECT dataset, count(*) FROM tokenized_samples GROUP BY ALL").fetchall()
        )
        normalized = dict(
            con.execute(
                "SELECT dataset, count(*) FROM normalized_conversations GROUP BY ALL"
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
    from mm_assets.resources import StorageResource

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
    assert all(u.startswith("file:///") and os.path.isfile(u[len("file://") :]) for u in urls)


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
    checks = result.get_asset_check_evaluations()
    assert [(c.check_name, c.passed) for c in checks] == [("image_availability_ratio", True)]


# -- bad input -----------------------------------------------------------------------


def _png_declaring(path: Path, width: int, height: int) -> None:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")
    )


def _write_bad_inputs() -> dict[int, str | None]:
    """Records of every bad kind beside good ones; returns index -> expected reason."""
    images = BAD_DIR / "coco" / "train2017"
    images.mkdir(parents=True, exist_ok=True)
    Image.effect_noise((80, 60), 50).convert("RGB").save(images / "good.jpg", quality=95)
    Image.new("RGB", (50, 70), "green").save(images / "good2.png")
    (images / "empty.jpg").write_bytes(b"")
    full = (images / "good.jpg").read_bytes()
    (images / "cut.jpg").write_bytes(full[: len(full) // 2])
    (images / "text.jpg").write_text("not an image")
    _png_declaring(images / "bomb.png", 50_000, 50_000)
    Image.new("RGB", (8, 8)).save(BAD_DIR / "outside.jpg")
    escape = images / "escape.jpg"
    if not escape.is_symlink():
        escape.symlink_to(BAD_DIR / "outside.jpg")

    def v4(image, *turns):
        return {"image": image, "conversations": [{"from": f, "value": v} for f, v in turns]}

    ask = ("human", "<image>\nWhat is it?")
    answer = ("gpt", "A picture.")
    cases: list[tuple[object, str | None]] = [
        (v4("coco/train2017/good.jpg", ask, answer), None),
        (v4("coco/train2017/good2.png", ask, answer, ("human", "More?"), ("gpt", "Green.")), None),
        (v4("coco/train2017/nope.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/empty.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/cut.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/text.jpg", ask, answer), "image_unavailable"),
        (v4("coco/../outside.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/escape.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/bomb.png", ask, answer), "image_unavailable"),
        (
            v4("coco/train2017/good.jpg", ("human", "<image>\n<image>\nTwo?"), answer),
            "image_placeholder_mismatch",
        ),
        (
            v4("coco/train2017/good.jpg", ("human", "No placeholder"), answer),
            "image_placeholder_mismatch",
        ),
        (v4(None, ("human", "Hello?")), "no_assistant_turn"),
        (v4(None), "empty_conversation"),
        ({"conversations": "human: hi / gpt: hello"}, "malformed_row"),
        (v4(None, ("narrator", "Once upon a time"), answer), "unknown_role"),
        (v4(None, ("human", "Just text?"), ("gpt", "Just text.")), None),
        (v4("coco/train2017/good.jpg", ask, answer), "duplicate_sample"),
        ([1, 2, 3], "malformed_row"),
    ]
    (BAD_DIR / "data.json").write_text(json.dumps([c for c, _ in cases]))
    return {i: reason for i, (_, reason) in enumerate(cases)}


def test_bad_inputs_are_quarantined_with_reasons_and_good_rows_kept() -> None:
    from mm_assets.resources import StorageResource

    expected = _write_bad_inputs()
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
    }
    tokenized = list(tables.iter_rows("tokenized_samples", "bad_inputs"))
    assert sorted(r["source_index"] for r in tokenized) == sorted(kept)


def test_low_availability_fails_the_blocking_check_and_stops_downstream(demo_dir: Path) -> None:
    """The demo data with a wrong image root: the check names the fix, and nothing
    downstream of the availability stage runs."""
    from mm_assets.definitions import defs

    job = defs.resolve_implicit_global_asset_job_def()
    result = job.execute_in_process(
        partition_key="demo_wrong_root", instance=dg.DagsterInstance.get(), raise_on_error=False
    )
    (check,) = result.get_asset_check_evaluations()
    assert not check.passed and "COCO_DIR" in check.description
    assert result.asset_materializations_for_node("coco_image_availability")
    assert not result.asset_materializations_for_node("normalized_conversations")
    assert not result.asset_materializations_for_node("tokenized_samples")
