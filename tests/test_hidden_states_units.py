"""Pure parts of the hidden-state stage: layer ids, cache keys, validation, disk budget,
the writer's lock, and parsing vLLM's responses."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest
import torch

from mm_assets.clients.connector_files import ConnectorDir
from mm_assets.clients.serve_args import extraction_configs
from mm_assets.clients.vllm_client import (
    ExtractionRequest,
    ExtractionResponse,
    HiddenStatesClient,
    RequestRefused,
    parse_response,
)
from mm_assets.common.request_settings import RequestSettings
from mm_assets.domain.model.hidden_state_checks import (
    HiddenStatesProblem,
    HiddenStatesRejected,
    validate_tensors,
)
from mm_assets.domain.model.hidden_state_plan import manifest_rows, plan_extraction
from mm_assets.domain.model.hidden_states import (
    HiddenStatesLayout,
    cache_key,
    default_layer_ids,
    text_config_facts,
    validate_layer_ids,
)
from mm_assets.services.extraction import (
    DiskBudgetError,
    HiddenStatesJob,
    StatesFetch,
    check_disk_budget,
    store_response,
    stored_blobs,
)
from mm_assets.services.request_stage import run_requests
from mm_assets.services.target import target_fingerprint
from mm_assets.storage.blobs import BlobStore


def test_default_layer_ids_and_validation() -> None:
    assert default_layer_ids(8) == [2, 4, 5, 8]
    assert default_layer_ids(32) == [2, 16, 29, 32]
    assert validate_layer_ids([1, 3, 6, 8], 8) == [1, 3, 6, 8]
    # a small target: the usual picks would repeat (vLLM reads a layer once)
    assert [default_layer_ids(n) for n in (4, 5, 6, 7)] == [
        [1, 2, 3, 4],
        [1, 2, 4, 5],
        [1, 3, 5, 6],
        [2, 3, 4, 7],
    ]
    for bad in ([2, 4, 5], [2, 4, 5, 7], [0, 4, 5, 8], [2, 4, 9, 8], [2, 4, 4, 8]):
        with pytest.raises(ValueError, match="last layer"):
            validate_layer_ids(bad, 8)


def test_text_config_facts_read_the_language_model_of_a_vlm() -> None:
    vlm = {"text_config": {"num_hidden_layers": 28, "hidden_size": 3584, "dtype": "bfloat16"}}
    facts = text_config_facts(vlm)
    assert (facts.num_layers, facts.hidden_size, facts.dtype) == (28, 3584, "bfloat16")
    llm = {"num_hidden_layers": 4, "hidden_size": 64, "torch_dtype": "float16"}
    assert text_config_facts(llm).dtype == "float16"


def test_cache_key_changes_with_everything_that_changes_the_states() -> None:
    base = cache_key("t", [2, 4, 5, 8], "float32", [1, 2, 3], ["img"])
    assert base == cache_key("t", [2, 4, 5, 8], "float32", [1, 2, 3], ["img"])
    variants = [
        cache_key("t2", [2, 4, 5, 8], "float32", [1, 2, 3], ["img"]),
        cache_key("t", [2, 4, 6, 8], "float32", [1, 2, 3], ["img"]),
        cache_key("t", [2, 4, 5, 8], "bfloat16", [1, 2, 3], ["img"]),
        cache_key("t", [2, 4, 5, 8], "float32", [1, 2, 4], ["img"]),
        cache_key("t", [2, 4, 5, 8], "float32", [1, 2, 3], ["other"]),
    ]
    assert len({base, *variants}) == 6


def test_target_fingerprint_follows_content(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    a = target_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 1000)
    assert target_fingerprint(tmp_path) != a


def _tensors(n: int, layers: int = 4, hidden: int = 8, dtype=torch.float32, ids=None) -> dict:
    return {
        "hidden_states": torch.randn(n, layers, hidden).to(dtype),
        "token_ids": torch.tensor(ids if ids is not None else list(range(n))),
    }


def test_validate_tensors_accepts_and_cuts_untruncated_renders() -> None:
    assert validate_tensors(_tensors(5), [0, 1, 2, 3, 4], 4, 8, "float32").shape == (5, 4, 8)
    # a truncated row: the server rendered the whole conversation, the row keeps a prefix
    assert validate_tensors(_tensors(7), [0, 1, 2, 3], 4, 8, "float32").shape == (4, 4, 8)


@pytest.mark.parametrize(
    ("tensors", "ids", "problem"),
    [
        (_tensors(5, ids=[0, 1, 9, 3, 4]), [0, 1, 2, 3, 4], HiddenStatesProblem.TOKEN_MISMATCH),
        (_tensors(3), [0, 1, 2, 3], HiddenStatesProblem.BAD_SHAPE),
        (_tensors(4, layers=3), [0, 1, 2, 3], HiddenStatesProblem.BAD_SHAPE),
        (_tensors(4, dtype=torch.bfloat16), [0, 1, 2, 3], HiddenStatesProblem.BAD_DTYPE),
        ({"hidden_states": torch.zeros(4, 4, 8)}, [0, 1, 2, 3], HiddenStatesProblem.BAD_FILE),
    ],
)
def test_validate_tensors_rejects(tensors, ids, problem) -> None:
    with pytest.raises(HiddenStatesRejected) as info:
        validate_tensors(tensors, ids, 4, 8, "float32")
    assert info.value.reason is problem


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_validate_tensors_rejects_non_finite_values(value: float) -> None:
    tensors = _tensors(4)
    tensors["hidden_states"][2, 1, 3] = value
    with pytest.raises(HiddenStatesRejected, match="from token 2"):
        validate_tensors(tensors, [0, 1, 2, 3], 4, 8, "float32")


def test_plan_skips_cached_and_duplicate_rows(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    settings = HiddenStatesLayout("t", [2, 4, 5, 8], 8, "float32")
    rows = [
        {"row_id": "a", "sample_id": "a", "input_ids": [1, 2], "image_hashes": []},
        {"row_id": "b", "sample_id": "b", "input_ids": [3, 4, 5], "image_hashes": []},
        {"row_id": "c", "sample_id": "c", "input_ids": [1, 2], "image_hashes": []},
    ]
    rows = [{**row, "loss_mask": [0] + [1] * (len(row["input_ids"]) - 1)} for row in rows]
    blobs.put_tensors(_tensors(3), settings.key([3, 4, 5], [], [0, 1, 1]))
    plan = plan_extraction(rows, settings, blobs.has)
    assert plan.missing == {"a"} and plan.cache_hits == 2 and plan.missing_tokens == 2


def test_the_manifest_records_blob_paths_relative_to_the_storage_root(tmp_path: Path) -> None:
    """A root moved (or mounted elsewhere on another worker) still resolves every blob
    the manifest lists; a manifest of older runs (absolute paths) still reads."""
    import shutil

    from mm_assets.storage import TableStore

    layout = HiddenStatesLayout("t", [2, 4, 5, 8], 8, "float32")
    blobs = BlobStore(tmp_path / "before")
    row = {"row_id": "a", "sample_id": "a", "input_ids": [1, 2, 3], "image_hashes": []}
    row["loss_mask"] = [0, 1, 1]
    blobs.put_tensors(_tensors(3), layout.key(row["input_ids"], [], row["loss_mask"]))
    plan = plan_extraction([row], layout, blobs.has)
    (listed,) = manifest_rows(plan, set(), layout, stored_blobs(blobs, layout))
    assert not Path(listed["path"]).is_absolute()
    shutil.move(tmp_path / "before", tmp_path / "after")
    moved = TableStore(tmp_path / "after").resolve(listed["path"])
    assert moved.is_file() and moved.is_relative_to(tmp_path / "after")
    assert TableStore(tmp_path / "x").resolve(str(moved)) == moved


def test_disk_budget_refuses_what_cannot_fit(tmp_path: Path, monkeypatch) -> None:
    blobs = BlobStore(tmp_path)
    settings = HiddenStatesLayout("t", [2, 16, 29, 32], 4096, "bfloat16")
    rows = [
        {
            "row_id": str(i), "sample_id": str(i), "input_ids": [i] * 8192, "image_hashes": [],
            "loss_mask": [0] * 4096 + [1] * 4096,
        }
        for i in range(10)
    ]  # fmt: skip
    plan = plan_extraction(rows, settings, blobs.has)
    needed = settings.estimate(81920, 40960, 10)
    assert needed > 4 * 4096 * 2 * 81920  # ~2.7 GB for ten 8k-token rows
    monkeypatch.setattr(BlobStore, "free_bytes", lambda self: needed // 2)
    with pytest.raises(DiskBudgetError, match="free space"):
        check_disk_budget(plan, settings, blobs)
    monkeypatch.setattr(BlobStore, "free_bytes", lambda self: needed * 2)
    assert check_disk_budget(plan, settings, blobs) == needed


def test_a_connector_file_is_opened_only_once_the_writer_released_it(tmp_path: Path) -> None:
    """The waiter returns only once the writer released its lock, never before; a lock
    never released is a `TimeoutError`."""
    path = tmp_path / "x.safetensors"
    connector = ConnectorDir(tmp_path)
    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    events: list[str] = []
    waiting, returned = threading.Event(), threading.Event()

    def wait() -> None:
        waiting.set()
        with connector.open(str(path), lock_timeout_s=10):
            events.append("returned")
        returned.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert waiting.wait(timeout=10)
    # still locked: the waiter must not return, however long it is given
    assert not returned.wait(timeout=0.2) and events == []
    path.write_bytes(b"done")
    events.append("released")
    os.close(fd)  # releases the lock
    waiter.join(timeout=10)
    assert not waiter.is_alive() and events == ["released", "returned"]
    fd2 = os.open(f"{path}.lock", os.O_WRONLY)
    fcntl.flock(fd2, fcntl.LOCK_EX)
    with pytest.raises(TimeoutError), connector.open(str(path), lock_timeout_s=0.2):
        pass
    os.close(fd2)


def test_parse_response_from_completions_and_chat() -> None:
    params = {"kv_transfer_params": {"hidden_states_path": "/x.safetensors"}}
    chat = parse_response({"prompt_token_ids": [1, 2], **params})
    completion = parse_response({"choices": [{"prompt_token_ids": [3]}], **params})
    assert (chat.prompt_token_ids, completion.prompt_token_ids) == ([1, 2], [3])
    with pytest.raises(RequestRefused, match="extract_hidden_states"):
        parse_response({"choices": [{"prompt_token_ids": [3]}]})


def test_extraction_configs_name_the_cpu_connector(tmp_path: Path) -> None:
    import json

    spec, transfer = extraction_configs([2, 4, 5, 8], tmp_path, use_cpu_connector=True)
    assert json.loads(spec)["draft_model_config"]["hf_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [2, 4, 5, 8]
    transfer = json.loads(transfer)
    assert transfer["kv_connector"] == "CpuHiddenStatesConnector"
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    stock = json.loads(extraction_configs([2, 4, 5, 8], tmp_path, use_cpu_connector=False)[1])
    assert (
        stock["kv_connector"] == "ExampleHiddenStatesConnector"
        and "kv_connector_module_path" not in stock
    )


def _response_file(tmp_path: Path, tensors: dict, name: str = "req.safetensors") -> Path:
    """A file as the connector leaves it: written, its `.lock` beside it, released."""
    from safetensors.torch import save_file

    path = tmp_path / "incoming" / name
    path.parent.mkdir(exist_ok=True)
    save_file(tensors, str(path))
    Path(f"{path}.lock").touch()
    return path


def test_store_response_moves_a_valid_file_into_the_blob_store(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    blobs, layout = BlobStore(tmp_path), HiddenStatesLayout("t", [2, 4, 5, 8], 8, "float32")
    tensors = _tensors(5)
    source = _response_file(tmp_path, tensors)
    request = ExtractionRequest("r", [0, 1, 2, 3, 4])
    key = layout.key(request.input_ids, [], [0, 0, 1, 1, 1])
    response = ExtractionResponse(list(range(5)), str(source))
    stored = store_response(
        StatesFetch(request, key, blobs, None), response, layout, ConnectorDir(source.parent)
    )
    assert stored == blobs.path(key) and blobs.has(key)
    assert torch.equal(load_file(str(stored))["hidden_states"], tensors["hidden_states"])
    assert not source.exists() and not Path(f"{source}.lock").exists()


def test_store_response_keeps_the_rows_prefix_of_an_untruncated_render(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    blobs, layout = BlobStore(tmp_path), HiddenStatesLayout("t", [2, 4, 5, 8], 8, "float32")
    tensors = _tensors(7)
    source = _response_file(tmp_path, tensors)
    request = ExtractionRequest("r", [0, 1, 2, 3])  # the row was truncated to 4 tokens
    response = ExtractionResponse(list(range(7)), str(source))
    stored = store_response(
        StatesFetch(request, "k" * 64, blobs, None), response, layout, ConnectorDir(source.parent)
    )
    kept = load_file(str(stored))
    assert kept["hidden_states"].shape == (4, 4, 8) and kept["token_ids"].tolist() == [0, 1, 2, 3]
    assert torch.equal(kept["hidden_states"], tensors["hidden_states"][:4])


@pytest.mark.parametrize(
    ("prompt_ids", "tensors", "problem"),
    [
        ([0, 1, 9], _tensors(3), HiddenStatesProblem.TOKEN_MISMATCH),
        ([0, 1, 2], _tensors(3, layers=3), HiddenStatesProblem.BAD_SHAPE),
        ([0, 1, 2], _tensors(3, dtype=torch.bfloat16), HiddenStatesProblem.BAD_DTYPE),
    ],
    ids=["vllm-rendered-other-ids", "wrong-layer-count", "wrong-dtype"],
)
def test_store_response_rejects_and_discards_what_it_cannot_use(
    tmp_path: Path, prompt_ids, tensors, problem
) -> None:
    blobs, layout = BlobStore(tmp_path), HiddenStatesLayout("t", [2, 4, 5, 8], 8, "float32")
    source = _response_file(tmp_path, tensors)
    request = ExtractionRequest("r", [0, 1, 2])
    with pytest.raises(HiddenStatesRejected) as info:
        response = ExtractionResponse(prompt_ids, str(source))
        store_response(
            StatesFetch(request, "k" * 64, blobs, None),
            response,
            layout,
            ConnectorDir(source.parent),
        )
    assert info.value.reason == problem
    assert not source.exists() and not any(blobs.dir.rglob("*.safetensors"))


def test_a_file_that_is_not_safetensors_rejects_its_row_not_the_partition(
    tmp_path: Path,
) -> None:
    """A connector file cut short or holding anything else is a row's `bad_file` once
    its tries are spent (before: the decoder's own error stopped the whole step)."""
    from mm_assets.services.extraction import store_outcome

    blobs, layout = BlobStore(tmp_path), HiddenStatesLayout("t", [2, 4, 5, 8], 8, "float32")
    source = tmp_path / "incoming" / "req.safetensors"
    source.parent.mkdir()
    source.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    request = ExtractionRequest("r", [0, 1, 2])
    fetch = StatesFetch(request, "k" * 64, blobs, None)
    answer = ExtractionResponse([0, 1, 2], str(source))
    outcome = store_outcome(fetch, answer, True, layout, ConnectorDir(source.parent))
    assert outcome.reason == "bad_file" and "req.safetensors" in outcome.detail


def test_a_row_answered_without_a_readable_file_is_requested_again(tmp_path: Path) -> None:
    """A server can answer and die before its connector wrote the file (seen with a
    server killed mid-run): the row goes out again instead of being rejected, and a file
    that never comes is a rejection that says where to look."""
    import json

    import httpx

    layout = HiddenStatesLayout("t", [2, 4, 5, 8], 8, "float32")
    rows = [
        {"row_id": row_id, "sample_id": row_id, "input_ids": ids, "image_hashes": [],
         "loss_mask": [0, 1, 1]}
        for row_id, ids in (("late", [1, 2, 3]), ("never", [4, 5, 6]))
    ]  # fmt: skip
    blobs = BlobStore(tmp_path / "root")
    plan = plan_extraction(rows, layout, blobs.has)
    asked: list[list[int]] = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m", "object": "model",
                                  "created": 0, "owned_by": "x"}], "object": "list"})  # fmt: skip
        prompt = json.loads(request.content)["prompt"]
        asked.append(prompt)
        name = f"answer{len(asked)}.safetensors"
        if prompt == [1, 2, 3] and asked.count(prompt) == 2:
            path = _response_file(tmp_path, _tensors(3, ids=prompt), name)
        else:  # a server that died while writing: its lock released, no file
            path = tmp_path / "incoming" / name
            path.parent.mkdir(exist_ok=True)
            Path(f"{path}.lock").touch()
        choice = {"index": 0, "text": "x", "finish_reason": "length", "prompt_token_ids": prompt}
        return httpx.Response(200, json={
            "id": "c", "object": "text_completion", "created": 0, "model": "m",
            "choices": [choice], "kv_transfer_params": {"hidden_states_path": str(path)},
        })  # fmt: skip

    transport = httpx.AsyncClient(transport=httpx.MockTransport(server))
    client = HiddenStatesClient(["http://vllm.test/v1"], http_client=transport)
    keys = plan.keys()
    fetches = [
        StatesFetch(ExtractionRequest(r["row_id"], r["input_ids"]), keys[r["row_id"]], blobs, None)
        for r in rows
    ]
    job = HiddenStatesJob(layout, ConnectorDir(tmp_path / "incoming"))
    tally = run_requests(client, fetches, job, len(plan.missing))
    assert tally.stored == 1 and blobs.has(plan.rows[0].key)
    assert asked.count([1, 2, 3]) == 2 and asked.count([4, 5, 6]) == 3
    (rejection,) = tally.rejections
    assert rejection["row_id"] == "never" and rejection["reason"] == "bad_file"
    assert "after 3 requests" in rejection["detail"] and "connector_dir" in rejection["detail"]


def _completions_server(tmp_path: Path, ask: list[list[int]] | None = None):
    """A stand-in vLLM answering every Completions request with a valid file for its
    prompt (written and released, as the connector leaves it)."""
    import itertools
    import json

    import httpx

    names = itertools.count()

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m", "object": "model",
                                  "created": 0, "owned_by": "x"}], "object": "list"})  # fmt: skip
        prompt = json.loads(request.content)["prompt"]
        path = _response_file(tmp_path, _tensors(len(prompt), ids=prompt),
                              f"answer{next(names)}.safetensors")  # fmt: skip
        choice = {"index": 0, "text": "x", "finish_reason": "length", "prompt_token_ids": prompt}
        return httpx.Response(200, json={
            "id": "c", "object": "text_completion", "created": 0, "model": "m",
            "choices": [choice], "kv_transfer_params": {"hidden_states_path": str(path)},
        })  # fmt: skip

    return httpx.AsyncClient(transport=httpx.MockTransport(server))


def test_counts_of_many_concurrent_stores_equal_the_manifest(tmp_path: Path) -> None:
    """Many storer threads finish at once; the counts the step reports (rows, tokens,
    bytes) are exactly what the manifest lists. The interpreter switches threads as
    often as it can, so a count updated from the storer threads would lose updates."""
    import sys

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        layout = HiddenStatesLayout("t", [2, 4, 5, 8], 8, "float32")
        rows = [
            {"row_id": f"r{i}", "sample_id": f"r{i}", "input_ids": [i, i + 1, *range(i % 7)],
             "image_hashes": [], "loss_mask": [0, 1, *([1] * (i % 7))]}
            for i in range(300)
        ]  # fmt: skip
        blobs = BlobStore(tmp_path / "root")
        plan = plan_extraction(rows, layout, blobs.has)
        client = HiddenStatesClient(
            ["http://vllm.test/v1"],
            RequestSettings(concurrency=32),
            http_client=_completions_server(tmp_path),
        )
        keys = plan.keys()
        fetches = [
            StatesFetch(
                ExtractionRequest(r["row_id"], r["input_ids"]), keys[r["row_id"]], blobs, None
            )
            for r in rows
        ]
        job = HiddenStatesJob(layout, ConnectorDir(tmp_path / "incoming"))
        tally = run_requests(client, fetches, job, len(plan.missing))
    finally:
        sys.setswitchinterval(previous)
    manifest = list(manifest_rows(plan, set(), layout, stored_blobs(blobs, layout)))
    assert len(manifest) == len(rows) and not tally.rejections
    assert tally.stored == len(manifest)
    assert tally.stored_tokens == sum(r["num_tokens"] for r in manifest)
    assert tally.stored_bytes == sum(r["bytes"] for r in manifest)
