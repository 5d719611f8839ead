"""Reuse records, and the training key that decides when a checkpoint can be reused."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from mm_assets.common.hashing import json_sha256
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.registry import DraftSpec, SourceCap
from mm_assets.services.draft_sources import TRAINING_TABLES
from mm_assets.services.training import SpeculatorJob, training_key
from mm_assets.storage import TableStore
from mm_assets.storage.records import load_record, save_record

SCHEMA = pa.schema([("value", pa.int64())])
DRAFT = DraftSpec(name="p", sources={"p": SourceCap()})


def test_records_round_trip_and_miss_on_another_key_or_a_broken_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "record.json"
    key = json_sha256(["weights", [1, 2], {"dtype": "float32"}, tmp_path])
    assert load_record(path, key) is None
    save_record(path, key, {"acceptance": 1.5})
    assert load_record(path, key) == {"acceptance": 1.5}
    assert (
        load_record(path, json_sha256(["weights", [1, 2], {"dtype": "bfloat16"}, tmp_path])) is None
    )
    path.write_text("{truncated")
    assert load_record(path, key) is None
    assert not list(path.parent.glob(".*.tmp"))


def _job(tmp_path: Path, **changes) -> SpeculatorJob:
    fields = {
        "partition": "p",
        "storage_root": tmp_path,
        "target_dir": tmp_path / "target",
        "target_config": {},
        "target_fingerprint": "abc",
        "layer_ids": [2, 4, 5, 8],
        "settings": SpeculatorSettings(epochs=2, draft_vocab_size=512),
        **changes,
    }
    return SpeculatorJob(**fields)


def test_training_key_follows_data_and_settings(tmp_path: Path) -> None:
    tables = TableStore(tmp_path)
    for table in TRAINING_TABLES:
        tables.write(table, "p", [{"value": 1}], SCHEMA)
    base = training_key(_job(tmp_path), DRAFT, tables)
    tables.write("tokenized_samples", "p", [{"value": 1}], SCHEMA)  # same content rewritten
    assert training_key(_job(tmp_path), DRAFT, tables) == base
    other = SpeculatorSettings(epochs=2)
    assert training_key(_job(tmp_path, settings=other), DRAFT, tables) != base
    changed = SpeculatorSettings(epochs=2, draft_vocab_size=512, held_out_fraction=0.2)
    assert training_key(_job(tmp_path, settings=changed), DRAFT, tables) != base
    assert training_key(_job(tmp_path, target_fingerprint="other"), DRAFT, tables) != base
    tables.write("hidden_states_manifest", "p", [{"value": 2}], SCHEMA)
    assert training_key(_job(tmp_path), DRAFT, tables) != base
