"""Loading local and hub-style sources, filters and deterministic subsampling."""

from __future__ import annotations

import json
from pathlib import Path

from mm_assets.domain.ingest.sources import build_filter, load_rows, read_hub, read_local, subsample
from mm_assets.registry import DatasetSpec


def test_jsonl_keeps_unparseable_lines_as_rows(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\nnot json\n\n{"a": 2}\n')
    rows = list(read_local(path))
    assert [r.source_index for r in rows] == [0, 1, 2]
    assert rows[1].parse_error and rows[1].record == "not json"
    assert rows[2].record == {"a": 2}


def test_directory_reads_all_files_in_name_order(tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text(json.dumps([{"x": 3}]))
    (tmp_path / "a.jsonl").write_text('{"x": 1}\n{"x": 2}\n')
    assert [(r.source_index, r.record["x"]) for r in read_local(tmp_path)] == [
        (0, 1),
        (1, 2),
        (2, 3),
    ]


def test_subsample_is_deterministic_and_keeps_source_order() -> None:
    rows = [type("R", (), {"i": i})() for i in range(100)]
    a = subsample(rows, 10, seed=3)
    assert [r.i for r in a] == sorted(r.i for r in a)
    assert [r.i for r in a] == [r.i for r in subsample(rows, 10, seed=3)]
    assert [r.i for r in a] != [r.i for r in subsample(rows, 10, seed=4)]
    assert len(subsample(rows, None, 0)) == 100


def test_image_prefix_filter_then_subsample(tmp_path: Path) -> None:
    records = [{"image": f"{'coco' if i % 2 else 'sam'}/{i}.jpg"} for i in range(20)]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(records))
    spec = DatasetSpec(
        name="d",
        format="sharegpt4v",
        path=str(path),
        filter={"image_prefix": "coco/"},
        max_samples=4,
    )
    loaded = load_rows(spec)
    assert (loaded.total, loaded.after_filter, len(loaded.rows)) == (20, 10, 4)
    assert all(r.record["image"].startswith("coco/") for r in loaded.rows)
    keep = build_filter(spec)
    assert not keep(next(iter(read_local(path))))  # row 0 is sam/


def test_hub_code_path_reads_through_load_dataset(tmp_path: Path) -> None:
    """The same `datasets.load_dataset(path, name=..., split=...)` call as for a hub id,
    here on a local directory (no hub is reachable from these machines)."""
    (tmp_path / "train.jsonl").write_text('{"q": "a"}\n{"q": "b"}\n')
    rows = list(read_hub(str(tmp_path), None, "train"))
    assert [r.record["q"] for r in rows] == ["a", "b"]
