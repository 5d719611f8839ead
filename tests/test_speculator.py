"""The trained speculator end to end on an on-policy partition (the target's own
replies): Dagster trains it on real vLLM hidden states, vLLM loads it and measures it
next to the untrained draft on the same prompts, and speculative decoding with it stays
lossless."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import dagster as dg
import pytest
import torch
from safetensors.torch import load_file

from mm_assets.clients.vllm_generation import generate_greedy
from mm_assets.common.hashing import file_sha256
from mm_assets.services.measurement import measurement_record
from mm_assets.storage.layout import StorageLayout
from tests.conftest import SESSION_HOME
from tests.plots import PLOT_SIZE, decode_plot

pytestmark = pytest.mark.slow
PARTITION = "demo_onpolicy"
REQUIRED_FIELDS = (
    "architectures", "speculators_model_type", "transformer_layer_config", "draft_vocab_size",
    "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output",
    "eagle_aux_hidden_state_layer_ids", "speculators_config",
)  # fmt: skip


CONFIG = {
    "draft_vocab_size": 512, "epochs": 4, "vllm_prompts": 12, "vllm_max_tokens": 32,
    "speculative_tokens": 3,
}  # fmt: skip


def _train(partition: str = PARTITION, **overrides) -> dict:
    from mm_assets.definitions import defs

    result = dg.materialize(
        [defs.get_assets_def("trained_speculator")],
        partition_key=partition,
        resources=defs.resources,
        instance=dg.DagsterInstance.get(),
        run_config={"ops": {"trained_speculator": {"config": {**CONFIG, **overrides}}}},
    )
    (mat,) = result.asset_materializations_for_node("trained_speculator")
    return {k: v.value for k, v in mat.metadata.items()}


@pytest.fixture(scope="module")
def trained(onpolicy_hidden_states) -> dict:
    return _train()


def test_checkpoint_fields_and_held_out_acceptance(trained: dict) -> None:
    ckpt = Path(trained["checkpoint"])
    config = json.loads((ckpt / "config.json").read_text())
    assert all(field in config for field in REQUIRED_FIELDS)
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(
        SESSION_HOME / "demo" / "target"
    )
    assert config["draft_vocab_size"] == 512 and config["eagle_aux_hidden_state_layer_ids"] == [
        2,
        4,
        5,
    ]
    assert config["mm_assets"]["layer_ids"] == [2, 4, 5, 8]
    assert trained["acceptance_length_estimate"] > trained["untrained_acceptance_length_estimate"]
    assert len(trained["per_position_acceptance_estimate"]) == 3
    assert decode_plot(trained["loss_curve"]).size == PLOT_SIZE
    assert decode_plot(trained["per_position_acceptance"]).size == PLOT_SIZE
    assert trained["reused_checkpoint"] is False


def _measurement(trained: dict, untrained: bool = False) -> dict:
    """What the measurement recorded of the trained draft (or the untrained one):
    prompts, generations, figures (one group of prompts, its one source's)."""
    draft = Path(trained["checkpoint"])
    label = f"{draft.name}.untrained" if untrained else draft.name
    record = measurement_record(draft.parent.parent, draft.name, label)
    return json.loads(record.read_text())["payload"][draft.name]


def test_the_trained_draft_beats_the_untrained_one_in_vllm(trained: dict) -> None:
    """Served on the same held-out prompts, the draft before training is almost never
    right; after training on the target's own replies vLLM accepts strictly more (a
    trainer that learned nothing would fail here)."""
    before, after = _measurement(trained, untrained=True), _measurement(trained)
    assert before["prompts"] == after["prompts"] and len(after["prompts"]) > 0
    assert before["generations"] == after["generations"]  # lossless either way
    untrained = trained["vllm_untrained_acceptance_length"]
    assert trained["vllm_acceptance_length"] > untrained and untrained < 1.2
    assert trained["vllm_acceptance_length"] > 1.2


def _table_rows() -> dict[tuple[str, str], dict]:
    from mm_assets.assets.resources import StorageResource

    with StorageResource().tables().connect() as con:
        cursor = con.execute("SELECT * FROM draft_measurements WHERE draft = ?", [PARTITION])
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    return {(r["served"], r["source"]): r for r in rows}


def test_the_measurement_is_a_table_row_per_draft_served_and_source(trained: dict) -> None:
    """`draft_measurements` holds what the metadata shows: the trained and the untrained
    draft on the dataset's held-out prompts (one source, so overall = it), with vLLM's
    counts, the offline estimate, the lossless count and what was served."""
    rows = _table_rows()
    assert set(rows) == {(s, p) for s in ("trained", "untrained") for p in (PARTITION, "overall")}
    for served, prefix in (("trained", ""), ("untrained", "untrained_")):
        row = rows[(served, PARTITION)]
        assert row["acceptance_length"] == pytest.approx(
            trained[f"vllm_{prefix}acceptance_length"], rel=1e-3
        )
        assert row["acceptance_length_estimate"] == pytest.approx(
            trained[f"vllm_{prefix}acceptance_length_estimate"], rel=1e-3
        )
        assert row["acceptance_length"] == pytest.approx(1 + row["accepted"] / row["drafts"])
        assert row["prompts"] == trained["vllm_prompts"] and row["speculative_tokens"] == 3
        # each reply's own counts (the interval's prompts) add up to the server's counters
        interval = trained[f"vllm_{prefix}acceptance_length_95ci"]
        assert interval.startswith(f"{row['acceptance_length']:.3f} [")
        assert interval.endswith(f"n={row['prompts']}")
        assert row["acceptance_low"] <= row["acceptance_length"] <= row["acceptance_high"]
        overall = rows[(served, "overall")]
        assert (overall["drafts"], overall["accepted"]) == (row["drafts"], row["accepted"])
    assert rows[("trained", PARTITION)]["lossless"] == trained["vllm_generations_same_as_target"]
    weights = Path(trained["checkpoint"]) / "model.safetensors"
    assert rows[("trained", PARTITION)]["served_sha256"] == file_sha256(weights)


def test_the_offline_estimate_predicts_what_vllm_measures(trained: dict) -> None:
    """Replaying speculative decoding over the stored hidden states of the replies vLLM
    generated gives the acceptance vLLM counts, within 10%, for the trained draft and the
    untrained one alike (an estimate that averaged per position would read high)."""
    for prefix in ("", "untrained_"):
        measured = trained[f"vllm_{prefix}acceptance_length"]
        estimate = trained[f"vllm_{prefix}acceptance_length_estimate"]
        assert abs(estimate - measured) <= 0.1 * measured, (prefix, estimate, measured)
    assert trained["vllm_prompts"] <= trained["held_out_replies"]


def test_vllm_counters_agree_with_what_it_generated(trained: dict) -> None:
    """The spec-decode counters read from /metrics describe these generations: every
    verified draft yields its accepted tokens plus one, so the tokens generated after each
    prompt's first equal drafts + accepted, up to the last step's overshoot."""
    measured = _measurement(trained)
    generations, k = measured["generations"], CONFIG["speculative_tokens"]
    drafts, rates = trained["vllm_drafts"], trained["vllm_per_position_acceptance"]
    assert trained["vllm_prompts"] == len(generations) == len(measured["prompts"]) > 0
    assert all(0 < len(g) <= CONFIG["vllm_max_tokens"] for g in generations)
    assert len(rates) == k and all(a >= b for a, b in itertools.pairwise(rates))
    accepted = (trained["vllm_acceptance_length"] - 1) * drafts
    assert accepted == pytest.approx(sum(rates) * drafts, abs=0.5)
    produced = sum(len(g) - 1 for g in generations)
    assert produced - len(generations) <= drafts + accepted <= produced + len(generations) * k


def test_speculative_decoding_with_the_draft_is_lossless(trained: dict, plain_vllm_server) -> None:
    """The measurement's greedy output with the draft equals the target's own greedy
    output, served without a draft, on the same held-out prompts (images included)."""
    measured = _measurement(trained)
    prompts = measured["prompts"]
    assert any(isinstance(m["content"], list) for p in prompts for m in p)
    url = plain_vllm_server.base_url
    access = plain_vllm_server.access
    plain = generate_greedy(url, access, prompts, max_tokens=CONFIG["vllm_max_tokens"])
    same = sum(a == b for a, b in zip(measured["generations"], plain, strict=True))
    assert same == len(prompts), f"{same}/{len(prompts)} identical"
    # the asset's own check, against the replies regeneration stored, agrees
    assert trained["vllm_generations_same_as_target"] == len(prompts)


def test_a_rerun_with_identical_inputs_reuses_checkpoint_and_measurement(trained: dict) -> None:
    """No training and no vLLM server the second time; a changed setting trains again."""
    weights = Path(trained["checkpoint"]) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = _train()
    assert again["reused_checkpoint"] is True and again["vllm_measurement_reused"] is True
    assert again["vllm_untrained_measurement_reused"] is True
    assert weights.stat().st_mtime_ns == before
    assert again["held_out_loss"] == trained["held_out_loss"]
    assert again["vllm_acceptance_length"] == trained["vllm_acceptance_length"]
    assert len(_table_rows()) == 4  # the reused measurement is not written twice
    changed = _train(epochs=1, measure_in_vllm=False)
    assert changed["reused_checkpoint"] is False and weights.stat().st_mtime_ns != before


def test_a_draft_starts_from_another_datasets_draft(trained: dict, demo_hidden_states) -> None:
    """`init_from` names the draft trained here on another dataset: the new draft starts
    from its weights (the untrained baseline is that draft, and replays above a random
    one on this dataset's held-out rows) and vocabulary, and records what it started from."""
    start = Path(trained["checkpoint"])
    warm = _train("demo_sharegpt4v_coco", init_from=PARTITION, epochs=1, measure_in_vllm=False)
    weights = start / "model.safetensors"
    assert warm["init_from"] == PARTITION and warm["init_sha256"] == file_sha256(weights)
    assert warm["draft_vocab_size"] == trained["draft_vocab_size"]
    config = json.loads((Path(warm["checkpoint"]) / "config.json").read_text())
    assert config["mm_assets"]["init_sha256"] == warm["init_sha256"]
    untrained = StorageLayout(SESSION_HOME).untrained_draft("demo_sharegpt4v_coco")
    baseline = load_file(str(untrained / "model.safetensors"))
    init = load_file(str(weights))
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight", "d2t"):
        assert torch.equal(baseline[name], init[name]), name
    random_start = trained["untrained_acceptance_length_estimate"]
    assert warm["untrained_acceptance_length_estimate"] > random_start


def test_vllm_serves_the_eagle_3_1_norms_as_they_were_trained(trained: dict) -> None:
    """A draft trained with EAGLE-3.1's norms (`fc_norm`, `norm_output`; vLLM 0.32 reads
    them and `norm_before_fc`, whose loss `test_conformance` checks) is loaded by vLLM
    with those weights, stays lossless, and vLLM accepts what the offline replay of our
    own forward pass predicts (a norm vLLM applied otherwise would break the agreement)."""
    norms = {"fc_norm": True, "norm_output": True}
    variant = _train(**norms, measure_untrained_in_vllm=False)  # last: it replaces the draft
    config = json.loads((Path(variant["checkpoint"]) / "config.json").read_text())
    assert {name: config[name] for name in norms} == norms
    measured, estimate = (
        variant["vllm_acceptance_length"],
        variant["vllm_acceptance_length_estimate"],
    )
    assert abs(estimate - measured) <= 0.1 * measured, (estimate, measured)
    assert measured > trained["vllm_untrained_acceptance_length"]
    assert variant["vllm_generations_same_as_target"] == variant["vllm_prompts"]
