"""The EAGLE-3 draft model, draft vocabulary, checkpoint format and training data."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mm_assets.clients.serve_args import speculative_decoding_args
from mm_assets.domain.model.acceptance import Acceptance, combine, replay_runs, summarize
from mm_assets.domain.model.checkpoint import checkpoint_config, draft_shape, draft_state
from mm_assets.domain.model.draft_parts import leading_correct
from mm_assets.domain.model.draft_vocab import build_draft_vocab, draft_vocab_from_mapping
from mm_assets.domain.model.eagle3 import Eagle3Config, Eagle3Draft, ttt_mask
from mm_assets.domain.model.families import draft_from
from mm_assets.domain.model.hidden_states import LAYER_CONVENTION
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.domain.model.trainer import (
    Ranks,
    StoredBatches,
    TrainingRun,
    batch_plan_sha256,
    evaluate,
    rank_batches,
    train,
)
from mm_assets.domain.model.training_data import (
    Batch,
    LayerMismatch,
    SampleRef,
    check_layer_ids,
    load_batch,
    pack,
    split,
)
from mm_assets.services.training import save_checkpoint
from mm_assets.storage.checkpoints import TrainStateFile, read_checkpoint

CFG = Eagle3Config(
    hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    intermediate_size=128, vocab_size=96, draft_vocab_size=48,
)  # fmt: skip


def _model(seed: int = 0, cfg: Eagle3Config = CFG) -> Eagle3Draft:
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    vocab = build_draft_vocab(
        {i: 100 - i for i in range(0, 96, 2)}, cfg.vocab_size, cfg.draft_vocab_size
    )
    model.init_from_target(
        torch.randn(cfg.vocab_size, 64), torch.randn(cfg.vocab_size, 64) * 3, torch.ones(64), vocab
    )
    return model


def _batch(lengths: list[int], seed: int = 1) -> Batch:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return Batch(
        input_ids=torch.randint(0, 96, (n,), generator=g),
        aux_hidden=torch.randn(n, 192, generator=g),
        last_hidden=torch.randn(n, 64, generator=g),
        loss_mask=torch.ones(n, dtype=torch.bool),
        position_ids=torch.cat([torch.arange(1, k + 1) for k in lengths]),
        segment=torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)]),
    )


def test_ttt_mask_is_causal_within_a_sample_plus_own_diagonal() -> None:
    segment = torch.tensor([0, 0, 0, 1, 1])
    mask = ttt_mask(segment, step=2)
    assert mask.shape == (5, 15)
    step0 = mask[:, :5]
    assert step0.tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1],
    ]  # fmt: skip
    for block in (mask[:, 5:10], mask[:, 10:]):
        assert torch.equal(block, torch.eye(5, dtype=torch.bool))


def test_no_step_sees_a_later_token_or_another_sample() -> None:
    """Changing a later token of one sample (or anything of another sample) leaves every
    earlier state of the sample unchanged (the draft layer's output, which its
    predictions read), at every TTT step."""
    model = _model()
    base = _batch([6, 5])

    def logits(batch) -> list[torch.Tensor]:
        captured = []
        handle = model.layers[0].register_forward_hook(
            lambda m, a, out: captured.append(out.detach())
        )
        with torch.no_grad():
            model(batch, ttt_steps=3)
        handle.remove()
        return captured

    reference = logits(base)
    later = dataclasses.replace(
        base, aux_hidden=base.aux_hidden.clone(), last_hidden=base.last_hidden.clone()
    )
    later.aux_hidden[4] += 1.0  # sample 0, position 4
    later.last_hidden[4] += 1.0
    changed = logits(later)
    for step in range(3):
        # inputs at step s are tokens shifted by s, so position p reads token p+s; positions
        # whose inputs are all before index 4 must not move
        assert torch.allclose(reference[step][:4], changed[step][:4], atol=1e-6)
        assert torch.allclose(reference[step][6:], changed[step][6:], atol=1e-6)
    other = dataclasses.replace(base, aux_hidden=base.aux_hidden.clone())
    other.aux_hidden[6:] += 1.0
    for a, b in zip(reference, logits(other), strict=True):
        assert torch.allclose(a[:6], b[:6], atol=1e-6)


def test_loss_decreases_on_a_fixed_batch() -> None:
    model = _model()
    batch = _batch([12, 9])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(30):
        loss, _ = model(batch, ttt_steps=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert model.embed_tokens.weight.grad is None and model.verifier_lm_head.weight.grad is None


def test_draft_vocab_mapping_round_trip() -> None:
    frequencies = {7: 50, 3: 50, 90: 10, 5: 1}
    vocab = build_draft_vocab(frequencies, target_vocab_size=100, size=6)
    assert vocab.selected.tolist() == [0, 1, 3, 5, 7, 90]  # seen tokens first, then fill by id
    assert (torch.arange(6) + vocab.d2t).tolist() == vocab.selected.tolist()
    assert int(vocab.t2d.sum()) == 6 and vocab.t2d[90] and not vocab.t2d[2]
    again = draft_vocab_from_mapping(vocab.d2t, 100)
    assert torch.equal(again.selected, vocab.selected)
    assert build_draft_vocab(frequencies, 100, 32000).size == 100
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        build_draft_vocab({100: 1}, 100, 10)


def test_leading_correct_counts_the_chain_until_its_first_miss() -> None:
    t, f = True, False
    correct = [torch.tensor([t, t, f, t]), torch.tensor([t, f, t, t])]
    valid = [torch.tensor([t, t, t, t]), torch.tensor([t, t, t, f])]
    # position 2 misses step 1, so its right step 2 does not count; 3's step 2 is invalid
    assert leading_correct(correct, valid).tolist() == [2, 1, 0, 1]


def test_replay_jumps_by_accepted_plus_one_within_each_reply() -> None:
    """Positions 0-5 are one reply of row 0, 6-7 unsupervised, 8-10 a reply of row 1: the
    walk starts at each reply's first position and skips what a verification produced."""
    lead = [3, 9, 9, 9, 0, 1, 9, 9, 0, 2, 9]
    supervised = [True] * 6 + [False] * 2 + [True] * 3
    segment = [0] * 8 + [1] * 3
    runs = replay_runs(lead, supervised, segment)
    assert runs == [(0, [3, 0, 1]), (1, [0, 2])]
    # a reply that ends where the next row's begins is still two replies
    assert replay_runs([0, 0], [True, True], [0, 1]) == [(0, [0]), (1, [0])]


def test_summary_is_tokens_per_verification_and_honours_max_tokens() -> None:
    summary = summarize([[3, 0, 1], [0, 2]], positions=3)
    assert summary == Acceptance(drafts=5, accepted=6, accepted_per_position=(3, 2, 1))
    assert summary.acceptance_length == pytest.approx(1 + 6 / 5)
    assert summary.per_position == pytest.approx([0.6, 0.4, 0.2])
    # a generation of 5 tokens: prefill gives 1, then 4 from [3], and it stops
    assert summarize([[3, 0, 1]], positions=3, max_tokens=5).drafts == 1
    # nothing verified: no rate at all (the one rule for zero drafts), not 1.0
    empty = summarize([], positions=3)
    assert empty.acceptance_length is None and empty.per_position == []


def test_acceptance_counts_add_up_as_one_count_would() -> None:
    """Sources or categories combine by summing counts: acceptance weighted by drafts,
    positions a shorter set never reached counted as zero."""
    easy = Acceptance(30, 60, (25, 20, 15))
    hard = Acceptance(10, 0, (0, 0))
    both = combine([easy, hard])
    assert both == Acceptance(40, 60, (25, 20, 15)) == easy + hard
    assert both.acceptance_length == pytest.approx(1 + 60 / 40)
    assert both.per_position == pytest.approx([25 / 40, 20 / 40, 15 / 40])
    assert combine([]) == Acceptance() and Acceptance().acceptance_length is None
    counted = Acceptance.from_counts(14.0, 21.0, [11.0, 7.0, 3.0])
    assert counted == Acceptance(14, 21, (11, 7, 3))
    assert Acceptance.from_record(dataclasses.asdict(counted)) == counted


def test_replay_weighs_what_verifications_visit_not_every_position() -> None:
    """Half the positions easy (all 3 accepted), half hard (none): averaging per position
    says 2.5 tokens per step, but decoding crosses an easy stretch of 8 in 2 steps and a
    hard one in 8, 16 tokens in 10 steps."""
    lead = [3] * 8 + [0] * 8
    (run,) = replay_runs(lead, [True] * 16, [0] * 16)
    assert summarize([run[1]], positions=3).acceptance_length == pytest.approx(16 / 10)


def _write_refs(tmp_path: Path, lengths: list[int], seed: int = 0) -> list[SampleRef]:
    g = torch.Generator().manual_seed(seed)
    refs = []
    for i, n in enumerate(lengths):
        path = tmp_path / f"{i}.safetensors"
        ids = torch.randint(0, 96, (n,), generator=g)
        save_file(
            {"hidden_states": torch.randn(n, 4, 64, generator=g), "token_ids": ids}, str(path)
        )
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        refs.append(SampleRef(f"row{i}", str(path), ids.tolist(), mask))
    return refs


def test_evaluation_replays_each_reply_of_each_row_whatever_the_packing(tmp_path: Path) -> None:
    mask = [0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0]
    refs = [
        SampleRef(r.row_id, r.path, r.input_ids, mask[: r.num_tokens])
        for r in _write_refs(tmp_path, [12, 12, 10])
    ]
    model = _model()
    packed = evaluate(model, refs, SpeculatorSettings(batch_tokens=64, ttt_steps=3))[1]
    alone = evaluate(model, refs, SpeculatorSettings(batch_tokens=1, ttt_steps=3))[1]
    assert packed == alone and list(packed) == ["row0", "row1", "row2"]
    # the shifted mask starts each reply one position early; a walk covers its reply
    # exactly (a chain never runs past the reply's last supervised position)
    for ref in refs:
        replies, lengths = packed[ref.row_id], (3, 4 if ref.num_tokens == 12 else 3)
        assert len(replies) == 2
        for reply, n in zip(replies, lengths, strict=True):
            assert sum(a + 1 for a in reply) == n


def test_batches_are_shifted_and_packed(tmp_path: Path) -> None:
    refs = _write_refs(tmp_path, [5, 7, 3])
    batch = load_batch(refs[:2])
    hidden = load_file(refs[0].path)["hidden_states"]
    assert batch.input_ids[:4].tolist() == refs[0].input_ids[1:]
    assert torch.equal(batch.aux_hidden[0], hidden[0, :3].reshape(-1))
    assert torch.equal(batch.last_hidden[0], hidden[1, 3])
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]  # the states'
    placed = dataclasses.replace(refs[0], position_ids=[0, 1, 1, 1, 4])  # an image held still
    assert load_batch([placed]).position_ids.tolist() == [0, 1, 1, 1]
    assert batch.segment.tolist() == [0] * 4 + [1] * 6
    assert [len(b) for b in pack(refs, 12)] == [2, 1]
    train, held = split(refs * 10, 0.3, seed=0)
    assert split(refs * 10, 0.3, seed=0) == (train, held) and train


def test_hidden_states_of_other_layer_ids_are_refused() -> None:
    ok = {"row_id": "a", "layer_ids": [2, 4, 5, 8], "layer_convention": LAYER_CONVENTION}
    check_layer_ids([ok], [2, 4, 5, 8])
    with pytest.raises(LayerMismatch, match="rematerialize"):
        check_layer_ids([ok], [1, 4, 5, 8])
    with pytest.raises(LayerMismatch):
        check_layer_ids([{**ok, "layer_convention": "hf_hidden_states"}], [2, 4, 5, 8])


def test_a_parallel_draft_reads_no_token_past_its_anchor_after_the_first_step() -> None:
    """P-EAGLE (`mask_token_id` set): steps after the first read the mask token and the
    learned `mask_hidden`, so the token after the next one, which EAGLE-3 is fed at step
    1, moves none of a parallel draft's later steps at the anchor; the state it reads is
    trained (it gets a gradient) and what vLLM loads as `mask_hidden`."""
    parallel_cfg = dataclasses.replace(CFG, mask_token_id=95)
    base = _batch([8])
    later = dataclasses.replace(base, input_ids=base.input_ids.clone())
    later.input_ids[3] = (later.input_ids[3] + 1) % 96  # what step 1 at position 2 is fed

    def steps(model: Eagle3Draft, batch: Batch) -> list[torch.Tensor]:
        captured: list[torch.Tensor] = []
        hook = model.layers[0].register_forward_hook(lambda m, a, out: captured.append(out))
        with torch.no_grad():
            model(batch, ttt_steps=3)
        hook.remove()
        return captured

    sequential, parallel = _model(), _model(cfg=parallel_cfg)
    pairs = zip(steps(sequential, base), steps(sequential, later), strict=True)
    moved = [(a[2] - b[2]).abs().max() for a, b in pairs]
    assert moved[0] == 0 and moved[1] > 1e-4  # EAGLE-3's step 1 reads that token
    for a, b in zip(steps(parallel, base), steps(parallel, later), strict=True):
        assert torch.allclose(a[:3], b[:3], atol=1e-6)
    loss, _ = parallel(base, ttt_steps=3)
    loss.backward()
    assert parallel.mask_hidden.grad is not None and parallel.mask_hidden.grad.abs().sum() > 0
    assert "mask_hidden" in draft_state(parallel)


def test_checkpoint_has_the_speculators_fields_and_round_trips(tmp_path: Path) -> None:
    model = _model()
    config = checkpoint_config(CFG, [2, 4, 5], "/models/target", ["LlamaForCausalLM"], 3, {"x": 1})
    save_checkpoint(model, config, tmp_path / "ckpt")
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    for key in (
        "speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size",
        "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
        "eagle_aux_hidden_state_layer_ids", "speculators_config",
    ):  # fmt: skip
        assert key in written, key
    assert written["speculators_config"]["verifier"]["name_or_path"] == "/models/target"
    assert written["transformer_layer_config"]["model_type"] == "llama"
    assert written["transformer_layer_config"]["num_hidden_layers"] == 1
    keys = set(load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    assert {
        "d2t",
        "t2d",
        "embed_tokens.weight",
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
    } <= keys
    assert "layers.0.self_attn.q_proj.weight" in keys and "layers.0.hidden_norm.weight" in keys
    assert not any(k.startswith("verifier_") for k in keys)
    loaded = draft_from(*read_checkpoint(tmp_path / "ckpt"), "ckpt")
    for key, value in loaded.state_dict().items():
        if not key.startswith("verifier_"):
            assert torch.equal(value, model.state_dict()[key]), key
    parallel_cfg = dataclasses.replace(CFG, mask_token_id=95)  # P-EAGLE: speculators' peagle
    parallel = checkpoint_config(parallel_cfg, [2, 4, 5], "/models/target", ["X"], 3, {})
    assert parallel["speculators_model_type"] == "peagle" and parallel["mask_token_id"] == 95
    assert parallel["speculators_config"]["algorithm"] == "peagle"
    assert draft_shape(parallel) == parallel_cfg and "mask_token_id" not in written
    assert '"parallel_drafting": true' in speculative_decoding_args(tmp_path, 3, "peagle")[1]
    full_cfg = dataclasses.replace(CFG, draft_vocab_size=96)
    torch.manual_seed(0)
    save_checkpoint(Eagle3Draft(full_cfg), config, tmp_path / "full")
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "full" / "model.safetensors")))


def _states(folder: Path) -> TrainStateFile:
    return TrainStateFile(folder / "train_state.pt")


def test_interrupted_training_resumes_to_the_same_result(tmp_path: Path) -> None:
    refs = _write_refs(tmp_path, [9, 14, 7, 11, 13, 8, 10, 12])
    settings = SpeculatorSettings(epochs=3, learning_rate=2e-3, batch_tokens=30, ttt_steps=2)

    straight = _model(seed=5)
    train(straight, refs[:6], refs[6:], settings, _states(tmp_path / "straight"))

    class Stop(Exception):
        pass

    def stop_after_first(epoch: int) -> None:
        if epoch == 1:
            raise Stop

    resumed = _model(seed=5)
    with pytest.raises(Stop):
        train(
            resumed,
            refs[:6],
            refs[6:],
            settings,
            _states(tmp_path / "resumed"),
            run=TrainingRun(after_epoch=stop_after_first),
        )
    resumed = _model(seed=5)  # a fresh process: nothing carried over but the saved state
    result = train(resumed, refs[:6], refs[6:], settings, _states(tmp_path / "resumed"))
    assert result.resumed_from_epoch == 1 and len(result.epoch_losses) == 3
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key


def test_full_vocab_scoring_counts_only_the_targets_own_greedy_token() -> None:
    """A draft that matches the teacher inside its vocabulary is still wrong wherever the
    target's greedy token lies outside the draft vocabulary."""
    model = _model()
    batch = _batch([10])
    full_head = torch.randn(96, 64)
    greedy = model.target_greedy_tokens(batch.last_hidden, full_head)
    expected = (model.verifier_norm(batch.last_hidden) @ full_head.T).argmax(-1)
    assert torch.equal(greedy, expected)
    with torch.no_grad():
        _, inside = model(batch, ttt_steps=1)
        _, full = model(batch, ttt_steps=1, target_greedy=greedy)
    proposals = model.to_target_ids(
        model.lm_head(model.norm(model.layers[0](
            model.embed_tokens(batch.input_ids), model.fc(batch.aux_hidden),
            batch.position_ids, [], ttt_mask(batch.segment, 0),
        ))).argmax(-1)
    )  # fmt: skip
    assert torch.equal(full[0].correct, proposals == greedy)
    outside = ~model.t2d[greedy]
    assert not full[0].correct[outside].any()
    assert inside[0].correct.shape == full[0].correct.shape


class _Recorded(StoredBatches):
    """The stored batches, noting which rows each pass asked for, in order."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, list[list[str]]]] = []

    def batches(self, groups: Sequence[Sequence[SampleRef]], label: str) -> Iterator[Batch | None]:
        self.passes.append((label, [[ref.row_id for ref in group] for group in groups]))
        yield from super().batches(groups, label)


def test_the_loop_asks_its_source_for_the_planned_batches_of_its_rank(tmp_path: Path) -> None:
    """Each epoch asks the batch source for exactly `rank_batches` (the plan that
    `batch_plan_sha256` hashes), so a source that fetches states (online) trains on the
    batches a stored run does; ranks share the batches out without overlap."""
    refs = _write_refs(tmp_path, [9, 14, 7, 11, 13, 8, 10, 12, 6, 9])
    settings = SpeculatorSettings(epochs=2, learning_rate=2e-3, batch_tokens=24, ttt_steps=2)
    source = _Recorded()
    run = TrainingRun(source=source)
    result = train(_model(), refs[:8], refs[8:], settings, _states(tmp_path), run=run)
    batches = pack(refs[:8], settings.batch_tokens)
    asked = dict(source.passes)
    for epoch in range(settings.epochs):
        planned = rank_batches(batches, settings.seed, epoch)
        assert asked[f"epoch {epoch + 1}"] == [[r.row_id for r in g] for g in planned]
    assert sorted(map(sorted, asked["epoch 1"])) == sorted(map(sorted, asked["epoch 2"]))
    assert asked["epoch 1"] != asked["epoch 2"]  # reshuffled each epoch
    # the held-out rows after every epoch (the kept epoch's figures are the result's)
    assert asked["held-out (epoch 1)"] == asked["held-out (epoch 2)"] == [["row8", "row9"]]
    assert result.batch_plan_sha256 == batch_plan_sha256(batches, settings, Ranks())
    # the plan names rows, not where their states are
    moved = [SampleRef(r.row_id, "elsewhere", r.input_ids, r.loss_mask) for r in refs[:8]]
    assert batch_plan_sha256(pack(moved, 24), settings, Ranks()) == result.batch_plan_sha256
    reseeded = settings.model_copy(update={"seed": 1})
    assert batch_plan_sha256(batches, reseeded, Ranks()) != result.batch_plan_sha256

    shares = [rank_batches(batches, settings.seed, 0, rank, 2) for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == len(batches) // 2
    ids = [{id(g) for g in share} for share in shares]
    assert not ids[0] & ids[1]
