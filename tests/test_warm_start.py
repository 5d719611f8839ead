"""`init_from`: where the starting draft is found, and why one is refused."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
import torch

from mm_assets.common.hashing import file_sha256
from mm_assets.domain.model.checkpoint import checkpoint_config
from mm_assets.domain.model.families import FAMILIES
from mm_assets.services.training import save_checkpoint
from mm_assets.services.warm_start import HUB_FILES, locate, warm_draft
from mm_assets.storage.layout import StorageLayout
from tests.test_eagle3 import CFG, _model

EAGLE3 = FAMILIES["eagle3"]


def _saved(folder: Path, layer_ids: list[int] = [1, 2, 3]) -> Path:  # noqa: B006
    model = _model(seed=7)
    config = checkpoint_config(CFG, layer_ids, "target", ["Qwen2ForCausalLM"], 3, {})
    return save_checkpoint(model, config, folder)


def test_a_draft_is_found_by_path_or_by_the_name_it_was_trained_under(tmp_path: Path) -> None:
    layout = StorageLayout(tmp_path / "root")
    trained = _saved(layout.draft("chat"))
    by_name = locate("chat", layout)
    by_path = locate(str(trained), layout)
    assert by_name.path == by_path.path == trained
    assert by_name.sha256 == file_sha256(trained / "model.safetensors")
    assert by_name.provenance()["init_from"] == "chat"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no model\.safetensors"):
        locate(str(tmp_path / "empty"), layout)


def test_a_hub_id_that_cannot_be_fetched_says_what_was_tried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not a local directory, not a draft trained"):
        locate("someone/eagle3-draft", StorageLayout(tmp_path))


def test_a_draft_for_another_target_is_refused_saying_which_part_differs(tmp_path: Path) -> None:
    source = locate(str(_saved(tmp_path / "d")), StorageLayout(tmp_path))
    embed = torch.zeros(CFG.vocab_size, CFG.hidden_size)
    model, vocab = warm_draft(source, EAGLE3, CFG, [1, 2, 3, 4], embed)
    assert vocab.size == CFG.draft_vocab_size and torch.equal(model.d2t, vocab.d2t)
    wider = dataclasses.replace(CFG, hidden_size=128)
    with pytest.raises(ValueError, match="hidden size 64 ≠ the target's 128"):
        warm_draft(source, EAGLE3, wider, [1, 2, 3, 4], embed)
    bigger = dataclasses.replace(CFG, vocab_size=200)
    with pytest.raises(ValueError, match="vocabulary 96 ≠ the target's 200"):
        warm_draft(source, EAGLE3, bigger, [1, 2, 3, 4], embed)
    with pytest.raises(ValueError, match="speculators_model_type 'eagle3' ≠ 'dflash'"):
        warm_draft(source, FAMILIES["dflash"], CFG, [1, 2, 3, 4], embed)


def test_a_draft_for_another_target_is_refused_before_its_weights_are_opened(
    tmp_path: Path,
) -> None:
    """Its config says enough: a draft of another size is refused even when its weights
    file would not load (nothing is downloaded or built for nothing); one that fits is
    then read and its broken weights are the error."""
    source = locate(str(_saved(tmp_path / "d")), StorageLayout(tmp_path))
    (source.path / "model.safetensors").write_bytes(b"not a safetensors file")
    embed = torch.zeros(CFG.vocab_size, CFG.hidden_size)
    with pytest.raises(ValueError, match="hidden size 64 ≠ the target's 128"):
        warm_draft(source, EAGLE3, dataclasses.replace(CFG, hidden_size=128), [1, 2, 3, 4], embed)
    with pytest.raises(Exception, match="header"):
        warm_draft(source, EAGLE3, CFG, [1, 2, 3, 4], embed)


def test_from_the_hub_only_the_drafts_config_and_weights_are_fetched() -> None:
    """The patterns `snapshot_download` is given, applied by the hub client's own filter to
    what a draft's repository may hold besides the draft."""
    from huggingface_hub.utils import filter_repo_objects

    files = ["config.json", "model.safetensors", "README.md", "optimizer.safetensors",
             "checkpoints/epoch_1/model.safetensors", "extra/config.json", "pytorch_model.bin",
             "training_state.safetensors"]  # fmt: skip
    assert sorted(filter_repo_objects(files, allow_patterns=HUB_FILES)) == [
        "config.json",
        "model.safetensors",
    ]


def _hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, commit: str) -> None:
    """`someone/eagle3-draft` in a hub cache at `commit` (refs/main names it), offline."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--someone--eagle3-draft"
    shutil.copytree(_saved(tmp_path / "published"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_hub_draft_records_its_commit_and_an_unpinned_one_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    _hub_cache(tmp_path, monkeypatch, commit)
    layout = StorageLayout(tmp_path / "root")
    with caplog.at_level(logging.WARNING, "mm_assets"):
        newest = locate("someone/eagle3-draft", layout)
    assert newest.path.name == commit and newest.provenance()["init_revision"] == commit
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("mm_assets")]
    assert "unpinned" in line and commit in line and "init_revision" in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, "mm_assets"):
        pinned = locate("someone/eagle3-draft", layout, revision=commit)
    assert pinned == newest and not caplog.records
    with pytest.raises(ValueError, match="init_revision 'main' pins a hub id"):
        locate(str(newest.path), layout, revision="main")
