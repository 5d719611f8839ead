"""Compact hidden-state storage: encoding bounds, the `needed` rule against what the loss
reads, the loader over mixed formats, refusals, and storing a received file compactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mm_assets.clients.connector_files import ConnectorDir
from mm_assets.clients.vllm_client import ExtractionRequest, ExtractionResponse
from mm_assets.domain.model import hidden_state_codec
from mm_assets.domain.model.eagle3 import Eagle3Config, Eagle3Draft
from mm_assets.domain.model.hidden_state_codec import (
    StoredStates,
    UnknownFormat,
    decode,
    encode,
    stored_error,
)
from mm_assets.domain.model.hidden_state_format import (
    BF16_ERROR_BOUND,
    FP8_ERROR_BOUND,
    FinalLayer,
    StorageDtype,
    StorageFormat,
    needed_positions,
)
from mm_assets.domain.model.hidden_states import HiddenStatesLayout
from mm_assets.domain.model.training_data import Batch, SampleRef, load_batch
from mm_assets.services.extraction import StatesFetch, store_response
from mm_assets.storage.blobs import BlobStore

FP8_NEEDED = StorageFormat(StorageDtype.FP8_E4M3, FinalLayer.NEEDED)
FP8_BOUND, BF16_BOUND = FP8_ERROR_BOUND, BF16_ERROR_BOUND


def max_relative_error(hidden: torch.Tensor, stored: StoredStates) -> list[float]:
    """The reference the encoder's own record is checked against: per layer, the largest
    error of a decoded element relative to its (token, layer) row's absolute maximum."""
    final = hidden[:, 3] if stored.final_positions is None else hidden[stored.final_positions, 3]
    pairs = [(hidden[:, k], stored.aux[:, k]) for k in range(3)] + [(final, stored.final)]
    return [
        float(((got - ref).abs() / ref.abs().amax(-1, keepdim=True).clamp_min(1e-30)).max())
        for ref, got in pairs
    ]


def _states(t: int = 40, h: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, as residual streams have (and one all-zero row)
    states = torch.randn(t, 4, h, generator=g) * torch.logspace(-3, 3, t)[:, None, None]
    states[5] = 0.0
    return states


@pytest.mark.parametrize(
    ("fmt", "bound"),
    [
        (FP8_NEEDED, FP8_BOUND),
        (StorageFormat(StorageDtype.FP8_E4M3), FP8_BOUND),
        (StorageFormat(StorageDtype.BF16, FinalLayer.NEEDED), BF16_BOUND),
    ],
    ids=lambda v: v.name if isinstance(v, StorageFormat) else "",
)
def test_decoding_stays_within_the_formats_bound(fmt: StorageFormat, bound: float) -> None:
    states, mask = _states(), [0] * 25 + [1] * 15
    tensors, metadata = encode(states, torch.arange(40), fmt, mask)
    stored = decode(tensors, metadata)
    errors = max_relative_error(states, stored)
    assert len(errors) == 4 and max(errors) <= bound and max(errors) > 0
    # what the encoder recorded is what decoding gives
    assert json.loads(metadata["max_rel_error"]) == pytest.approx(errors, rel=1e-3)
    assert torch.equal(stored.aux[5], torch.zeros(3, 64))  # a zero row stays exact
    kept = 15 if fmt.final_layer == FinalLayer.NEEDED else 40
    assert stored.final.shape == (kept, 64)
    assert tensors["token_ids"].dtype == torch.int32


@pytest.mark.parametrize(
    "fmt", [FP8_NEEDED, StorageFormat(StorageDtype.BF16)], ids=lambda f: f.name
)
def test_encoding_in_blocks_equals_one_pass_and_leaves_the_input_alone(
    fmt: StorageFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoder walks rows in cache-sized blocks: a ragged split (7-row blocks over 40
    rows) must give the bytes of a single block, and scaling in place must not touch the
    caller's float32 states."""
    states, mask = _states(), [0] * 25 + [1] * 15
    received = states.clone()
    monkeypatch.setattr(hidden_state_codec, "BLOCK_ELEMENTS", 1 << 30)
    whole, whole_meta = encode(states, torch.arange(40), fmt, mask)
    monkeypatch.setattr(hidden_state_codec, "BLOCK_ELEMENTS", 7 * 3 * 64)
    blocked, blocked_meta = encode(states, torch.arange(40), fmt, mask)
    assert blocked_meta == whole_meta and blocked.keys() == whole.keys()
    for name, tensor in whole.items():
        assert blocked[name].dtype == tensor.dtype
        assert torch.equal(blocked[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert torch.equal(states, received)


def test_needed_keeps_exactly_the_positions_the_loss_reads() -> None:
    """Which layer-L states does the loss read? Build the set from the forward pass's own
    bookkeeping — at step s, query i is counted (`valid`) and compared with the teacher
    of shifted position i+s, i.e. original position i+s+1 — not from the rule, and
    compare it with `needed_positions`."""
    cfg = Eagle3Config(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        intermediate_size=128, vocab_size=96, draft_vocab_size=96,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    mask = [0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0, 0, 1]  # replies, a stray token, the end
    n = len(mask)
    shifted_mask = torch.tensor(mask[1:], dtype=torch.bool)
    with torch.no_grad():
        batch = Batch(
            input_ids=torch.randint(0, 96, (n - 1,)), aux_hidden=torch.randn(n - 1, 192),
            last_hidden=torch.randn(int(shifted_mask.sum()), 64), loss_mask=shifted_mask,
            position_ids=torch.arange(1, n), segment=torch.zeros(n - 1, dtype=torch.long),
        )  # fmt: skip
        _, steps = model(batch, ttt_steps=3)
    read = sorted({int(i) + s + 1 for s, st in enumerate(steps) for i in st.valid.nonzero()})
    assert read == [i for i in needed_positions(mask) if i >= 1] == [2, 3, 5, 6, 7, 10, 13]


def _blob(path: Path, states: torch.Tensor, fmt: StorageFormat, mask: list[int]) -> str:
    ids = torch.arange(states.shape[0])
    if fmt.is_native:
        save_file({"hidden_states": states, "token_ids": ids}, str(path))
    else:
        tensors, metadata = encode(states, ids, fmt, mask)
        save_file(tensors, str(path), metadata)
    return str(path)


def test_the_loader_reads_any_mix_of_formats_in_one_batch(tmp_path: Path) -> None:
    formats = [StorageFormat(), FP8_NEEDED, StorageFormat(StorageDtype.BF16)]
    masks = [[0] * 20 + [1] * 20, [0] * 10 + [1] * 5 + [0] * 10 + [1] * 15, [0, 1] * 20]
    states = [_states(seed=i) for i in range(3)]
    refs = [
        SampleRef(f"r{i}", _blob(tmp_path / f"{i}.st", s, f, m), list(range(40)), m)
        for i, (s, f, m) in enumerate(zip(states, formats, masks, strict=True))
    ]
    mixed = load_batch(refs)
    native_refs = [
        SampleRef(r.row_id, _blob(tmp_path / f"n{i}.st", s, StorageFormat(), r.loss_mask),
                  r.input_ids, r.loss_mask)
        for i, (r, s) in enumerate(zip(refs, states, strict=True))
    ]  # fmt: skip
    native = load_batch(native_refs)
    assert mixed.last_hidden.shape == native.last_hidden.shape
    assert mixed.last_hidden.shape[0] == int(mixed.loss_mask.sum())
    assert torch.equal(mixed.input_ids, native.input_ids)
    # rows compare within each format's bound, relative to each row's maximum
    for got, ref in (
        (mixed.aux_hidden, native.aux_hidden),
        (mixed.last_hidden, native.last_hidden),
    ):
        scale = ref.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        assert ((got - ref).abs() / scale).max() <= FP8_BOUND


def test_unknown_formats_and_foreign_masks_are_refused(tmp_path: Path) -> None:
    states, mask = _states(), [0] * 30 + [1] * 10
    tensors, metadata = encode(states, torch.arange(40), FP8_NEEDED, mask)
    with pytest.raises(UnknownFormat, match="rematerialize hidden_states"):
        decode(tensors, {**metadata, "format": "mm_assets.hidden_states.compact/9"})
    path = _blob(tmp_path / "b.st", states, FP8_NEEDED, mask)
    other = [0] * 20 + [1] * 20  # a mask reading positions the blob did not keep
    with pytest.raises(ValueError, match="another mask"):
        load_batch([SampleRef("r", path, list(range(40)), other)])
    subset = [0] * 35 + [1] * 5  # fewer supervised positions: what was kept suffices
    assert load_batch([SampleRef("r", path, list(range(40)), subset)]).last_hidden.shape[0] == 5


def test_keys_follow_the_format_and_native_keeps_its_old_keys() -> None:
    native = HiddenStatesLayout("t", [2, 4, 5, 8], 64, "float32")
    compact = HiddenStatesLayout("t", [2, 4, 5, 8], 64, "float32", FP8_NEEDED)
    ids, mask = [1, 2, 3, 4], [0, 0, 1, 1]
    assert native.key(ids, [], mask) == native.key(ids, [], [0, 1, 1, 1])
    assert compact.key(ids, [], mask) != native.key(ids, [], mask)
    assert compact.key(ids, [], mask) != compact.key(ids, [], [0, 1, 1, 1])
    fp8_all = HiddenStatesLayout(
        "t", [2, 4, 5, 8], 64, "float32", StorageFormat(StorageDtype.FP8_E4M3)
    )
    assert fp8_all.key(ids, [], mask) == fp8_all.key(ids, [], [0, 1, 1, 1])
    # bytes: a 3584-wide target, 1000 tokens of which 300 supervised, against bf16's 8 H:
    # (3 + 0.3) H fp8 bytes + scales, ids and positions
    reference = 1000 * 4 * 3584 * 2
    assert 3.3 / 8 < FP8_NEEDED.estimate_bytes(1000, 300, 3584, "bfloat16") / reference < 0.42


def test_a_received_file_is_stored_compactly_with_its_error(tmp_path: Path) -> None:
    states = _states(t=6, h=8)
    source = tmp_path / "incoming" / "req.safetensors"
    source.parent.mkdir()
    save_file({"hidden_states": states, "token_ids": torch.arange(6)}, str(source))
    Path(f"{source}.lock").touch()
    blobs = BlobStore(tmp_path)
    layout = HiddenStatesLayout("t", [2, 4, 5, 8], 8, "float32", FP8_NEEDED)
    mask = [0, 0, 0, 1, 1, 0]
    request = ExtractionRequest("r", list(range(6)))
    key = layout.key(request.input_ids, [], mask)
    response = ExtractionResponse(list(range(6)), str(source))
    path = store_response(
        StatesFetch(request, key, blobs, mask), response, layout, ConnectorDir(source.parent)
    )
    with safe_open(str(path), framework="pt") as blob:
        assert set(blob.keys()) == {
            "aux", "aux_scale", "final", "final_scale", "final_runs", "token_ids",
        }  # fmt: skip
        assert blob.metadata()["dtype"] == "fp8_e4m3"
        assert blob.get_tensor("final_runs").tolist() == [[3, 5]]
    errors = stored_error(path)
    assert errors == json.loads(json.dumps(errors)) and 0 < max(errors) <= FP8_BOUND
    assert not source.exists()
