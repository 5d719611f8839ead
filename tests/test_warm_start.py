"""`init_from`: where the starting draft is found, and why one is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mm_assets.common.hashing import file_sha256
from mm_assets.domain.model.checkpoint import checkpoint_config
from mm_assets.services.training import save_checkpoint
from mm_assets.services.warm_start import locate, warm_draft
from mm_assets.storage.layout import StorageLayout
from tests.test_eagle3 import CFG, _model


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
    model, vocab = warm_draft(source, CFG, [1, 2, 3, 4], embed)
    assert vocab.size == CFG.draft_vocab_size and torch.equal(model.d2t, vocab.d2t)
    wider = dataclasses.replace(CFG, hidden_size=128)
    with pytest.raises(ValueError, match="hidden size 64 ≠ the target's 128"):
        warm_draft(source, wider, [1, 2, 3, 4], embed)
    bigger = dataclasses.replace(CFG, vocab_size=200)
    with pytest.raises(ValueError, match="vocabulary 96 ≠ the target's 200"):
        warm_draft(source, bigger, [1, 2, 3, 4], embed)
