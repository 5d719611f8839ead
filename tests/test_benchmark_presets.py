"""The built-in benchmark presets read local copies shaped like the hub's datasets.

Each test registers the preset itself with its `hub` replaced by a local `path`, so what is
checked is the real preset's format, columns and category settings, through the ingest and
prep assets as Dagster runs them (no server, no network).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mm_assets.registry import DatasetSpec, load_registry
from mm_assets.storage import schemas
from tests.conftest import SESSION_HOME, materialize

STAGES = ["raw_dataset", "coco_image_availability", "normalized_conversations"]
MT_BENCH_CATEGORIES = [
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
]  # fmt: skip
SPECULATOR_SUBSETS = [
    "HumanEval", "math_reasoning", "qa", "question", "rag", "summarization", "tool_call",
    "translation", "writing",
]  # fmt: skip


def _local_preset(name: str, path: Path) -> DatasetSpec:
    """The built-in preset `name`, read from `path` instead of the hub."""
    preset = load_registry()[name]
    assert preset.hub is not None and preset.is_benchmark
    return DatasetSpec.model_validate({**preset.model_dump(), "hub": None, "path": str(path)})


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Callable[[DatasetSpec], None]:
    """Registers a spec under its (built-in, so already partitioned) name for one test."""
    from mm_assets.assets import partitions

    def register(spec: DatasetSpec) -> None:
        assert spec.name in partitions.dataset_partitions.get_partition_keys()
        monkeypatch.setitem(partitions.REGISTRY, spec.name, spec)

    return register


def _prepared(name: str) -> tuple[list[dict], list[dict], dict]:
    """Materialize the ingest and prep stages; the kept rows, the quarantined rows and
    normalized_conversations' metadata."""
    from mm_assets.assets.resources import StorageResource

    result = materialize(name, STAGES)
    assert result.success
    (mat,) = result.asset_materializations_for_node("normalized_conversations")
    tables = StorageResource().tables()
    kept = list(tables.iter_rows("normalized_conversations", name))
    quarantined = list(tables.iter_rows("normalized_conversations_quarantine", name))
    return kept, quarantined, {k: v.value for k, v in mat.metadata.items()}


def _write_mt_bench(root: Path) -> int:
    """80 prompts of two turns, 10 per category, as the hub's parquet file holds them."""
    rows = [
        {
            "prompt": [f"{category} question {i}?", f"Follow-up to {category} question {i}."],
            "prompt_id": 81 + n,
            "category": category,
            "reference": [f"reference {i}"] if category == "math" else [],
        }
        for n, (category, i) in enumerate((c, i) for c in MT_BENCH_CATEGORIES for i in range(10))
    ]
    (root / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "data" / "train-00000-of-00001.parquet")
    return len(rows)


def test_the_mt_bench_preset_keeps_every_prompt_with_two_turns_and_its_category(
    tmp_path: Path, registered
) -> None:
    rows = _write_mt_bench(tmp_path / "mt_bench")
    registered(_local_preset("mt_bench", tmp_path / "mt_bench"))
    kept, quarantined, metadata = _prepared("mt_bench")
    assert quarantined == [] and len(kept) == rows == 80
    assert Counter(r["category"] for r in kept) == dict.fromkeys(MT_BENCH_CATEGORIES, 10)
    for row in kept:
        turns = json.loads(row["turns"])
        assert [t["role"] for t in turns] == ["user", "user"]
        assert turns[1]["content"].startswith("Follow-up to ")
        assert not row["multimodal"]
    assert "| math | 10 |" in metadata["rows_by_category"]


def _write_speculator_benchmarks(root: Path) -> int:
    """One jsonl file per subset, each row a `prompt` string."""
    root.mkdir(parents=True)
    for subset in SPECULATOR_SUBSETS:
        lines = [json.dumps({"prompt": f"A {subset} prompt, number {i}."}) for i in range(3)]
        (root / f"{subset}.jsonl").write_text("\n".join(lines) + "\n")
    return 3 * len(SPECULATOR_SUBSETS)


def test_the_speculator_benchmarks_preset_keeps_every_prompt(tmp_path: Path, registered) -> None:
    rows = _write_speculator_benchmarks(tmp_path / "speculator_benchmarks")
    registered(_local_preset("speculator_benchmarks", tmp_path / "speculator_benchmarks"))
    kept, quarantined, _ = _prepared("speculator_benchmarks")
    assert quarantined == [] and len(kept) == rows
    assert all([t["role"] for t in json.loads(r["turns"])] == ["user"] for r in kept)


def test_the_speculator_benchmarks_categories_are_its_file_names(
    tmp_path: Path, registered
) -> None:
    _write_speculator_benchmarks(tmp_path / "speculator_benchmarks")
    registered(_local_preset("speculator_benchmarks", tmp_path / "speculator_benchmarks"))
    kept, _, metadata = _prepared("speculator_benchmarks")
    assert Counter(r["category"] for r in kept) == dict.fromkeys(SPECULATOR_SUBSETS, 3)
    assert "| tool_call | 3 |" in metadata["rows_by_category"]


def test_the_mmstar_preset_reads_each_question_with_the_image_inside_its_row(
    tmp_path: Path, registered
) -> None:
    """MMStar keeps its images in the rows (the `datasets.Image` feature): ingest writes
    them to files, and every row is a user turn holding its image, then its question."""
    from tests.test_embedded_images import _jpeg, _mmstar_parquet

    images = [_jpeg((40 + i, 30)) for i in range(6)]
    (tmp_path / "mmstar").mkdir()
    _mmstar_parquet(tmp_path / "mmstar" / "val.parquet", images)
    registered(_local_preset("mmstar", tmp_path / "mmstar"))
    kept, quarantined, metadata = _prepared("mmstar")
    assert quarantined == [] and len(kept) == len(images)
    assert Counter(r["category"] for r in kept) == {"coarse perception": 3, "math": 3}
    for row in kept:
        (user, answer) = json.loads(row["turns"])
        assert [p["type"] for p in user["content"]] == ["image", "text"]
        assert answer == {"role": "assistant", "content": "A"}
        assert row["multimodal"] and Path(row["image_paths"][0]).is_file()
    assert "| math | 3 |" in metadata["rows_by_category"]


def _trl_row(parts: list[str], images: list[bytes]) -> dict:
    content = [{"type": p, "text": "What is shown?" if p == "text" else None} for p in parts]
    return {
        "messages": [{"role": "user", "content": content}],
        "images": [{"bytes": b, "path": None} for b in images],
        "category": "vqa",
    }


def test_a_trl_benchmark_quarantines_each_bad_row_with_its_reason_and_keeps_the_rest(
    tmp_path: Path,
) -> None:
    """TRL's layout with the images inside: an image part with no image left, an image
    left over, a truncated image and a decompression bomb are each quarantined with their
    reason; every good row is kept."""
    import datasets

    from mm_assets.assets.resources import StorageResource
    from tests.bad_inputs import png_declaring
    from tests.test_embedded_images import _jpeg, _png

    good, other = _jpeg(), _png((30, 30), "green")
    png_declaring(tmp_path / "bomb.png", 20_000, 20_000)
    rows = [
        _trl_row(["image", "text"], [good]),
        _trl_row(["text"], []),
        _trl_row(["image", "image", "text"], [good, other]),
        _trl_row(["image", "image", "text"], [other]),  # a part with no image left
        _trl_row(["image", "text"], [good, other]),  # an image left over
        _trl_row(["image", "text"], [good[: len(good) // 2]]),  # truncated
        _trl_row(["image", "text"], [(tmp_path / "bomb.png").read_bytes()]),
    ]
    rows[1]["messages"][0]["content"][0]["text"] = "A question without a picture."
    part = {"type": datasets.Value("string"), "text": datasets.Value("string")}
    features = datasets.Features(
        {
            "messages": datasets.List(
                {"role": datasets.Value("string"), "content": datasets.List(part)}
            ),
            "images": datasets.List(datasets.Image()),
            "category": datasets.Value("string"),
        }
    )
    path = SESSION_HOME / "trl_adversarial" / "data.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(path))
    materialize("trl_adversarial", STAGES)
    tables = StorageResource().tables()
    kept = sorted(
        r["source_index"] for r in tables.iter_rows("normalized_conversations", "trl_adversarial")
    )
    reasons = {
        r["source_index"]: (r["reason"], r["detail"])
        for r in tables.iter_rows("normalized_conversations_quarantine", "trl_adversarial")
    }
    assert kept == [0, 1, 2]
    assert {i: reason for i, (reason, _) in reasons.items()} == {
        3: "image_placeholder_mismatch",
        4: "image_placeholder_mismatch",
        5: "image_unavailable",
        6: "image_unavailable",
    }
    assert "unreadable" in reasons[5][1] and "too_large" in reasons[6][1]


def test_a_row_from_a_file_takes_the_files_name_as_its_category(tmp_path: Path) -> None:
    """Prep reads the file a raw row came from (`source_file`) for its category."""
    from mm_assets.services.prep import normalize_partition
    from mm_assets.storage import TableStore

    spec = _local_preset("speculator_benchmarks", tmp_path)
    tables = TableStore(tmp_path / "store")
    raw = schemas.RAW_DATASET
    rows = [
        {"source_index": i, "record": json.dumps({"prompt": f"p{i}"}), "parse_error": None,
         "source_file": f"{subset}.jsonl"}
        for i, subset in enumerate(SPECULATOR_SUBSETS)
    ]  # fmt: skip
    tables.write("raw_dataset", spec.name, rows, raw)
    tables.write("coco_image_availability", spec.name, [], schemas.IMAGE_AVAILABILITY)
    report = normalize_partition(spec, tables)
    assert report.categories == dict.fromkeys(SPECULATOR_SUBSETS, 1)
    kept = tables.iter_rows("normalized_conversations", spec.name)
    assert [r["category"] for r in kept] == SPECULATOR_SUBSETS


def test_a_drafts_benchmark_step_reads_exactly_the_benchmarks_its_entry_lists() -> None:
    """`speculator_benchmark` of a dataset depends on its own draft and on the prepared
    conversations of the benchmarks its entry lists, nothing else; `draft_benchmark` of a
    draft of several datasets on the union of its sources' benchmarks."""
    from mm_assets.assets.partitions import (
        DATASET_DRAFTS,
        DRAFTS,
        REGISTRY,
        benchmarks_of,
        dataset_partitions,
        draft_partitions,
    )

    def upstream(drafts: dict, partitions: dg.StaticPartitionsDefinition, name: str) -> set:
        return set(
            benchmarks_of(drafts)
            .get_upstream_mapped_partitions_result_for_partitions(
                partitions.subset_with_partition_keys([name]), partitions, dataset_partitions
            )
            .partitions_subset.get_partition_keys()
        )

    for name, spec in REGISTRY.items():
        if not spec.is_benchmark:
            assert upstream(DATASET_DRAFTS, dataset_partitions, name) == set(spec.benchmarks)
    for name, draft in DRAFTS.items():
        listed = {b for s in draft.sources for b in REGISTRY[s].benchmarks}
        assert upstream(DRAFTS, draft_partitions, name) == listed
    assert REGISTRY["demo_onpolicy"].benchmarks == ["demo_benchmark"]  # the tests' registry
    assert DRAFTS["onpolicy_capped"].benchmarks == ("demo_benchmark",)
    assert REGISTRY["demo_benchmark"].is_benchmark


def test_a_training_entry_may_list_only_benchmark_entries() -> None:
    from mm_assets.registry.loading import benchmark_problems

    registry = load_registry()
    chat = registry["sharegpt"].model_copy(update={"benchmarks": ["mt_bnch", "ultrachat"]})
    problems = benchmark_problems({**registry, "sharegpt": chat})
    assert len(problems) == 2
    assert "'mt_bnch' is not an entry (did you mean 'mt_bench'?" in problems[0]
    assert "'ultrachat' is a training dataset" in problems[1]
    with pytest.raises(ValueError, match="categories are for benchmarks"):
        DatasetSpec(name="x", path="x.json", format="sharegpt", category="qa")
