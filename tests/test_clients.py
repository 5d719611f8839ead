"""The vLLM clients without a vLLM server: the extraction client against a mock
transport, the Prometheus counters from a recorded exposition, the managed server's
command line, and its start-up failures with stand-in processes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import astuple
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pydantic
import pytest
from PIL import Image

from mm_assets.assets.ingest import ImageAvailabilityConfig
from mm_assets.clients import parent_guard, serve_args, vllm_server, warm_servers
from mm_assets.clients.media_urls import (
    MAX_INLINE_BYTES,
    ImageNotAsProbed,
    ServerAccess,
    file_url_path,
    outgoing_url,
)
from mm_assets.clients.serve_args import extraction_args, speculative_decoding_args
from mm_assets.clients.vllm_client import (
    CircuitOpen,
    ExtractionRequest,
    ExtractionResponse,
    HiddenStatesClient,
    RequestRefused,
    token_in_url,
)
from mm_assets.clients.vllm_metrics import (
    ServingCounters,
    SpecDecodeCounters,
    counters_after,
    server_counters,
    server_counters_from_metrics_text,
)
from mm_assets.clients.vllm_server import (
    EngineOptions,
    ManagedVllmServer,
    ServerStartupError,
    ServerUnavailable,
    death_explained,
)
from mm_assets.common.request_settings import RequestSettings
from mm_assets.domain.ingest.images import probe_image
from mm_assets.domain.prep.conversations import image_urls, to_vllm_messages
from mm_assets.domain.prep.formats import image_part

BASE_URL = "http://vllm.test/v1"
HIDDEN_STATES_PATH = "/tmp/x.safetensors"
MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "x"}]}
COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 0,
    "model": "m",
    "choices": [
        {"index": 0, "text": "x", "finish_reason": "length", "prompt_token_ids": [1, 2, 3]}
    ],
    "kv_transfer_params": {"hidden_states_path": HIDDEN_STATES_PATH},
}
CHAT_COMPLETION = {
    "id": "chat-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "x"},
            "finish_reason": "length",
            "token_ids": [9],
        }
    ],
    "prompt_token_ids": [4, 5, 6],
    "kv_transfer_params": {"hidden_states_path": HIDDEN_STATES_PATH},
}

Outcome = int | Exception


class FakeVllm:
    """A MockTransport handler: `/models` always answers; each generation request takes
    the next scripted outcome (a status or an exception to raise), then `default`."""

    def __init__(self, script: Sequence[Outcome] = (), default: Outcome = 200) -> None:
        self.script = list(script)
        self.default = default
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json=MODELS)
        outcome = self.script.pop(0) if self.script else self.default
        if isinstance(outcome, Exception):
            raise outcome
        if outcome != 200:
            return httpx.Response(outcome, json={"error": {"message": f"status {outcome}"}})
        if request.url.path == "/inference/v1/generate":
            ids = [1, 2, 2, 2, 3]  # the image placeholder expanded back by the server
            params = {"hidden_states_path": HIDDEN_STATES_PATH}
            return httpx.Response(200, json={"prompt_token_ids": ids, "kv_transfer_params": params})
        chat = request.url.path.endswith("/chat/completions")
        return httpx.Response(200, json=CHAT_COMPLETION if chat else COMPLETION)

    @property
    def generation_requests(self) -> list[httpx.Request]:
        return [r for r in self.requests if not r.url.path.endswith("/models")]


IMAGES = ServerAccess("k", Path("/images"))
"""What the fake's servers may open: images under /images."""


def _client(fake: FakeVllm, access: ServerAccess = IMAGES, **kwargs) -> HiddenStatesClient:
    transport = httpx.MockTransport(fake)
    return HiddenStatesClient(
        [BASE_URL],
        RequestSettings(**kwargs),
        access,
        http_client=httpx.AsyncClient(transport=transport),
        backoff_s=0.001,
    )


def _extract(client: HiddenStatesClient, request: ExtractionRequest) -> ExtractionResponse:
    async def main() -> ExtractionResponse:
        try:
            return await client.extract(request)
        finally:
            await client.close()

    return asyncio.run(main())


def _run(client: HiddenStatesClient, count: int) -> list[ExtractionResponse | Exception]:
    """Extract `count` text requests; the outcomes handed to `handle`."""
    outcomes: list[ExtractionResponse | Exception] = []

    async def handle(_: ExtractionRequest, outcome: ExtractionResponse | Exception) -> None:
        outcomes.append(outcome)

    async def main() -> None:
        try:
            requests = (ExtractionRequest(f"r{i}", [1, 2, 3]) for i in range(count))
            await client.map(requests, client.extract, handle)
        finally:
            await client.close()

    asyncio.run(main())
    return outcomes


TEXT_REQUEST = ExtractionRequest("r0", [1, 2, 3])


@pytest.mark.parametrize(
    "failures",
    [[503, 503], [429, httpx.ConnectError("connection refused")]],
    ids=["503", "429-then-refused"],
)
def test_transient_failures_are_retried(failures: list[Outcome]) -> None:
    fake = FakeVllm(failures)
    client = _client(fake, max_retries=4)
    response = _extract(client, TEXT_REQUEST)
    assert response == ExtractionResponse([1, 2, 3], HIDDEN_STATES_PATH)
    assert len(fake.generation_requests) == 3
    assert client.requests_sent == 3


def test_retries_give_up_as_a_per_sample_failure() -> None:
    fake = FakeVllm(default=503)
    client = _client(fake, max_retries=2)
    with pytest.raises(RequestRefused, match="gave up after 3 tries"):
        _extract(client, TEXT_REQUEST)
    assert len(fake.generation_requests) == 3


def test_a_refused_request_is_not_retried() -> None:
    fake = FakeVllm([400])
    client = _client(fake, max_retries=4)
    with pytest.raises(RequestRefused, match="HTTP 400"):
        _extract(client, TEXT_REQUEST)
    assert len(fake.generation_requests) == 1


def test_a_response_without_hidden_states_is_refused() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json=MODELS)
        return httpx.Response(200, json={**COMPLETION, "kv_transfer_params": None})

    client = HiddenStatesClient(
        [BASE_URL], http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    with pytest.raises(RequestRefused, match="hidden_states_path"):
        _extract(client, TEXT_REQUEST)


def test_text_request_goes_to_completions_with_the_token_ids() -> None:
    fake = FakeVllm()
    _extract(_client(fake), TEXT_REQUEST)
    (request,) = fake.generation_requests
    assert request.url.path == "/v1/completions"
    body = json.loads(request.content)
    assert body["model"] == "m"
    assert body["prompt"] == [1, 2, 3]
    assert body["max_tokens"] == 1
    assert body["return_token_ids"] is True
    assert "messages" not in body


def test_a_row_with_images_goes_to_the_token_in_route_with_its_images() -> None:
    """Its ids are sent (placeholder run collapsed) with the images as content parts, to
    the server root's `/inference/v1/generate`, not under the OpenAI `/v1` prefix."""
    url = "file:///images/a.png"
    fake = FakeVllm()
    request = ExtractionRequest("r0", [1, 2, 2, 2, 3], (url,), [1, 2, 3])
    response = _extract(_client(fake), request)
    assert response == ExtractionResponse([1, 2, 2, 2, 3], HIDDEN_STATES_PATH)
    (sent,) = fake.generation_requests
    assert sent.url.path == "/inference/v1/generate"
    body = json.loads(sent.content)
    assert body["token_ids"] == [1, 2, 3] and body["model"] == "m"
    assert body["content_parts"] == [{"type": "image_url", "url": url}]
    assert body["sampling_params"]["max_tokens"] == 1 and body["return_token_ids"] is True


def test_the_token_in_route_keeps_a_gateways_path_prefix() -> None:
    """Behind a gateway that routes on a path prefix, the route is under the same prefix."""
    for base, route in [
        ("http://vllm.test/v1/", "http://vllm.test/inference/v1/generate"),
        ("https://gw.example/team-a/v1/", "https://gw.example/team-a/inference/v1/generate"),
        ("https://gw.example/team-a", "https://gw.example/team-a/inference/v1/generate"),
        ("https://gw.example/a/b/v1", "https://gw.example/a/b/inference/v1/generate"),
    ]:
        assert str(token_in_url(httpx.URL(base))) == route, base


def test_a_row_with_images_goes_to_the_token_in_route_under_the_fleets_prefix() -> None:
    """Sent through a gateway with a password in its URL: the route keeps the prefix, and
    a server without it is named with the password masked."""
    fake = FakeVllm([200, 404])
    client = HiddenStatesClient(
        ["https://user:pw-s3cret@gw.test/team-a/v1"],
        access=IMAGES,
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(fake)),
    )
    request = ExtractionRequest("r0", [1, 2, 2, 2, 3], ("file:///images/a.png",), [1, 2, 3])

    async def twice() -> Exception | None:
        await client.extract(request)
        try:
            await client.extract(request)
        except RequestRefused as refused:
            return refused
        finally:
            await client.close()
        return None

    refused = asyncio.run(twice())
    assert [r.url.path for r in fake.generation_requests] == ["/team-a/inference/v1/generate"] * 2
    assert "https://user:***@gw.test/team-a/inference/v1/generate not found" in str(refused)
    assert "pw-s3cret" not in str(refused)


def test_only_images_the_server_may_open_go_as_files_the_rest_inline(tmp_path: Path) -> None:
    """vLLM opens files under one directory. A file there is sent as its URL; one outside
    it is sent as its bytes (a link is never followed: see below), and a name with URL
    syntax is the file the URL names."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    inside = root / "odd #1 %41.png"
    inside.write_bytes(b"inside")
    (outside / "x.png").write_bytes(b"outside")
    assert file_url_path(inside.as_uri()) == inside
    assert outgoing_url(inside.as_uri(), root) == inside.as_uri()
    url = (outside / "x.png").as_uri()
    assert (
        outgoing_url(url, root) == "data:image/png;base64," + base64.b64encode(b"outside").decode()
    )
    assert outgoing_url(url, None).startswith("data:image/png;base64,")
    data = "data:image/png;base64,AAAA"
    assert outgoing_url(data, root) == data

    fake = FakeVllm()
    request = ExtractionRequest("r0", [1, 2, 3], (inside.as_uri(), (outside / "x.png").as_uri()))
    _extract(_client(fake, ServerAccess("k", root)), request)
    (sent,) = fake.generation_requests
    parts = [p["url"] for p in json.loads(sent.content)["content_parts"]]
    assert parts[0] == inside.as_uri() and parts[1].startswith("data:image/png;base64,")
    assert sent.headers["authorization"] == "Bearer k"


def test_an_image_gone_since_its_probe_fails_its_request_only(tmp_path: Path) -> None:
    request = ExtractionRequest("r0", [1, 2, 3], ((tmp_path / "gone.png").as_uri(),))
    with pytest.raises(RequestRefused, match=r"could not be read.*coco_image_availability"):
        _extract(_client(FakeVllm(), ServerAccess("k", tmp_path / "elsewhere")), request)


def _picture(path: Path, color: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), color).save(path)
    return path


def _probed_url(path: Path) -> str:
    """The URL prep writes for an image: the file its probe checked, and the probe's hash."""
    turns = [{"role": "user", "content": [image_part(probe_image(path.name, path))]}]
    (url,) = image_urls(to_vllm_messages(turns))
    return url


def _extract_all(
    client: HiddenStatesClient, requests: list[ExtractionRequest]
) -> dict[str, ExtractionResponse | Exception]:
    outcomes: dict[str, ExtractionResponse | Exception] = {}

    async def handle(request: ExtractionRequest, outcome: ExtractionResponse | Exception) -> None:
        outcomes[request.row_id] = outcome

    async def main() -> None:
        try:
            await client.map(requests, client.extract, handle)
        finally:
            await client.close()

    asyncio.run(main())
    return outcomes


def test_an_image_changed_since_its_probe_fails_its_request_only(tmp_path: Path) -> None:
    """The probe's hash rides with the URL (never to the server, which opens files
    itself); an image sent inline whose bytes differ now is refused, the others go."""
    root = tmp_path / "root"
    kept, changed = _picture(tmp_path / "a.png", "red"), _picture(tmp_path / "b.png", "red")
    kept_url, changed_url = _probed_url(kept), _probed_url(changed)
    assert kept_url == f"{kept.as_uri()}#sha256={hashlib.sha256(kept.read_bytes()).hexdigest()}"
    _picture(changed, "blue")  # same size, other bytes
    with pytest.raises(ImageNotAsProbed, match="changed since its probe"):
        outgoing_url(changed_url, root)
    _picture(root / "c.png", "green")
    assert outgoing_url(_probed_url(root / "c.png"), root) == (root / "c.png").as_uri()
    fake = FakeVllm()
    urls = {"kept": kept_url, "changed": changed_url}
    requests = [ExtractionRequest(name, [1, 2, 3], (url,)) for name, url in urls.items()]
    outcomes = _extract_all(_client(fake, ServerAccess("k", root)), requests)
    assert isinstance(outcomes["kept"], ExtractionResponse)
    assert isinstance(outcomes["changed"], RequestRefused)
    assert re.search(r"changed since its probe.*coco_image_availability", str(outcomes["changed"]))
    (sent,) = fake.generation_requests
    (part,) = json.loads(sent.content)["content_parts"]
    assert part["url"] == "data:image/png;base64," + base64.b64encode(kept.read_bytes()).decode()


def test_a_link_put_in_an_images_place_is_refused_not_followed(tmp_path: Path) -> None:
    """Even to a file with the very bytes probed: the probe recorded the real path, so a
    link at it now is something else (and could point anywhere the worker may read)."""
    picture = _picture(tmp_path / "a.png", "red")
    url = _probed_url(picture)
    copy = tmp_path / "copy.png"
    copy.write_bytes(picture.read_bytes())
    picture.unlink()
    picture.symlink_to(copy)
    with pytest.raises(ImageNotAsProbed, match="symbolic link"):
        outgoing_url(url, tmp_path / "elsewhere")
    fake = FakeVllm()
    request = ExtractionRequest("r0", [1, 2, 3], (url,))
    with pytest.raises(RequestRefused, match=r"symbolic link.*coco_image_availability"):
        _extract(_client(fake, ServerAccess("k", tmp_path / "elsewhere")), request)
    assert fake.generation_requests == []


def test_a_file_over_the_byte_cap_is_refused_before_it_is_read_whole(tmp_path: Path) -> None:
    """A sparse terabyte: read whole it would exhaust memory; at most cap + 1 bytes are."""
    huge = tmp_path / "huge.png"
    with huge.open("wb") as fh:
        fh.truncate(1 << 40)
    with pytest.raises(ImageNotAsProbed, match=f"more than {1 << 20} bytes"):
        outgoing_url(huge.as_uri(), None, max_bytes=1 << 20)
    with pytest.raises(ImageNotAsProbed, match=f"more than {MAX_INLINE_BYTES} bytes"):
        outgoing_url(huge.as_uri(), None)
    with pytest.raises(pydantic.ValidationError, match="max_image_bytes"):
        ImageAvailabilityConfig(max_image_bytes=MAX_INLINE_BYTES + 1)


def test_each_start_draws_a_new_key_given_in_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Not on the command line (any local user can list it), and not the caller's
    VLLM_API_KEY; a fixed key, when given, is used as is."""
    started: list[tuple[list[str], dict[str, str]]] = []

    real_popen = subprocess.Popen

    def popen(cmd: list[str], **kwargs: object) -> subprocess.Popen:
        if "vllm.entrypoints.openai.api_server" not in cmd:
            return real_popen(cmd, **kwargs)  # type: ignore[call-overload]
        started.append((cmd, kwargs["env"]))  # type: ignore[arg-type]
        return real_popen(["true"], start_new_session=True)

    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    monkeypatch.setattr(ManagedVllmServer, "_wait_until_healthy", lambda self: None)
    monkeypatch.setenv("VLLM_API_KEY", "the-callers-key")
    server = ManagedVllmServer("m", [], None, tmp_path / "vllm.log")
    keys = []
    for _ in range(2):
        server.start()
        keys.append(server.access.api_key)
        server.stop(grace_s=1)
    assert len(set(keys)) == 2 and all(len(k) >= 32 for k in keys)
    assert [env["VLLM_API_KEY"] for _, env in started] == keys
    assert not any(k in " ".join(cmd) for k in keys for cmd, _ in started)
    assert keys[0] not in repr(server) and keys[1] not in repr(server)
    fixed = ManagedVllmServer("m", [], None, tmp_path / "vllm.log", api_key="fleet-key")
    fixed.start()
    fixed.stop(grace_s=1)
    assert fixed.access.api_key == "fleet-key" and started[-1][1]["VLLM_API_KEY"] == "fleet-key"


def test_a_server_without_the_token_in_route_is_named_with_the_fix() -> None:
    request = ExtractionRequest("r0", [1, 2, 2, 3], ("file:///images/a.png",), [1, 2, 3])
    with pytest.raises(RequestRefused, match="--enable-scale-out"):
        _extract(_client(FakeVllm([404])), request)


@pytest.mark.parametrize(
    "failure", [503, httpx.ConnectError("connection refused")], ids=["503", "refused"]
)
def test_circuit_opens_after_consecutive_failures_and_stops_the_run(failure: Outcome) -> None:
    fake = FakeVllm(default=failure)
    client = _client(fake, concurrency=1, max_retries=0, breaker_failures=3)
    with pytest.raises(ExceptionGroup) as info:
        _run(client, 10)
    # `run` leaves its TaskGroup's ExceptionGroup as it is: callers catch `except* CircuitOpen`
    opened, rest = info.value.split(CircuitOpen)
    assert rest is None and opened is not None
    message = str(opened.exceptions[0])
    assert "3 requests in a row failed all their 1 tries" in message and BASE_URL in message
    assert client.requests_sent == 3


def test_a_success_resets_the_consecutive_failures() -> None:
    fake = FakeVllm([503, 503, 200, 503, 503, 200, 503, 503])
    client = _client(fake, concurrency=1, max_retries=0, breaker_failures=3)
    outcomes = _run(client, 8)
    assert len(outcomes) == 8
    assert sum(isinstance(o, ExtractionResponse) for o in outcomes) == 2
    assert sum(isinstance(o, RequestRefused) for o in outcomes) == 6


def _fleet(hosts: dict[str, FakeVllm], **kwargs) -> HiddenStatesClient:
    """A client over one fake server per host (`http://<host>/v1`)."""

    def route(request: httpx.Request) -> httpx.Response:
        return hosts[request.url.host](request)

    transport = httpx.AsyncClient(transport=httpx.MockTransport(route))
    urls = [f"http://{host}/v1" for host in hosts]
    return HiddenStatesClient(
        urls, RequestSettings(**kwargs), http_client=transport, backoff_s=0.001
    )


def test_a_dead_server_leaves_the_rotation_and_its_requests_go_to_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One of two servers refuses every connection: each of its failed tries is retried
    at once on the live one, it is taken out after `breaker_failures` tries, and every
    request is answered."""
    dead = FakeVllm(default=httpx.ConnectError("connection refused"))
    live = FakeVllm()
    client = _fleet({"a.test": dead, "b.test": live}, concurrency=4, breaker_failures=3)
    with caplog.at_level(logging.INFO, logger="mm_assets.clients.vllm_client"):
        outcomes = _run(client, 40)
    lines = [r.getMessage() for r in caplog.records if r.name == "mm_assets.clients.vllm_client"]
    assert len(outcomes) == 40 and all(isinstance(o, ExtractionResponse) for o in outcomes)
    a, b = client.server_stats()
    # tries already on their way when it was taken out fail too: at most one per slot
    assert 3 <= a["failed_tries"] <= 3 + 4 and a["answered"] == 0 and a["taken_out"] == 1
    assert not a["in_rotation"]
    assert b["answered"] == 40 and b["failed_tries"] == 0 and b["in_rotation"]
    assert b["tokens"] == 40 * 3
    assert len(dead.generation_requests) == a["failed_tries"]
    assert len(live.generation_requests) == 40
    (line,) = lines
    assert "http://a.test/v1 taken out of rotation after 3 failed tries" in line


def test_a_fleet_urls_password_is_in_no_log_error_or_server_figure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Servers behind basic auth (`https://user:pass@host/v1`): the logs, the circuit's
    error and the per-server figures (the step's metadata) show `user:***@host`. (httpx's
    own request lines, at INFO, are not among the loggers a step's log keeps.)"""
    hosts = {"a.test": FakeVllm(default=503), "b.test": FakeVllm(default=503)}
    transport = httpx.MockTransport(lambda request: hosts[request.url.host](request))
    client = HiddenStatesClient(
        [f"http://fleet:pw-s3cret@{host}/v1" for host in hosts],
        RequestSettings(concurrency=2, max_retries=1, breaker_failures=2),
        http_client=httpx.AsyncClient(transport=transport),
        backoff_s=0.001,
    )
    with caplog.at_level(logging.INFO, "mm_assets"), pytest.raises(ExceptionGroup) as info:
        _run(client, 10)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("mm_assets")]
    shown = [*ours, str(info.value.exceptions[0])]
    shown += [str(client.server_stats())]
    assert "http://fleet:***@a.test/v1 taken out of rotation" in shown[0]
    assert all("pw-s3cret" not in text for text in shown)
    assert [s["url"] for s in client.server_stats()] == [
        "http://fleet:***@a.test/v1",
        "http://fleet:***@b.test/v1",
    ]


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_server_out_of_rotation_is_probed_and_comes_back() -> None:
    """A server that failed comes back after `probe_after_s` with one request; while it
    is out, the other takes everything."""
    flaky = FakeVllm([503, 503])
    steady = FakeVllm()
    client = _fleet(
        {"a.test": flaky, "b.test": steady}, concurrency=1, breaker_failures=2, probe_after_s=30
    )
    clock = client.clock = FakeClock()

    async def main() -> list[ExtractionResponse]:
        try:
            replies = [await client.extract(TEXT_REQUEST) for _ in range(4)]
            clock.advance(29.5)
            replies.append(await client.extract(TEXT_REQUEST))  # before the probe: b answers
            a, b = client.server_stats()
            assert not a["in_rotation"] and a["answered"] == 0 and b["answered"] == 5
            clock.advance(0.5)
            return replies + [await client.extract(TEXT_REQUEST) for _ in range(3)]
        finally:
            await client.close()

    assert len(asyncio.run(main())) == 8
    a, b = client.server_stats()
    assert a["taken_out"] == 1 and a["in_rotation"] and a["answered"] >= 1
    # before the probe every request went to b; after it, a takes its share again
    assert a["answered"] + b["answered"] == 8 and b["answered"] >= 4


def test_a_lone_server_overloaded_for_a_moment_is_ridden_out() -> None:
    """Every request in flight fails once at the same moment (eight 503s in a row): a
    lone server stays in rotation and each request's retry gets through."""
    fake = FakeVllm([503] * 8)
    client = _client(fake, concurrency=8, breaker_failures=8)
    outcomes = _run(client, 16)
    assert len(outcomes) == 16 and all(isinstance(o, ExtractionResponse) for o in outcomes)
    (stats,) = client.server_stats()
    assert stats["failed_tries"] == 8 and stats["taken_out"] == 0 and stats["in_rotation"]


def test_the_last_server_stays_in_rotation_and_the_circuit_opens_on_it() -> None:
    """Both servers fail: the first is taken out, the last one in rotation is not (a lone
    server's overload is ridden out by backoff); requests that fail all their tries open
    the circuit, and the message says what each server last answered."""
    refused = httpx.ConnectError("connection refused")
    client = _fleet(
        {"a.test": FakeVllm(default=refused), "b.test": FakeVllm(default=503)},
        concurrency=2, max_retries=1, breaker_failures=2,
    )  # fmt: skip
    with pytest.raises(ExceptionGroup) as info:
        _run(client, 10)
    opened, rest = info.value.split(CircuitOpen)
    assert rest is None and opened is not None
    message = str(opened.exceptions[0])
    assert "2 requests in a row failed all their 2 tries" in message
    assert "http://a.test/v1 (out of rotation, APIConnectionError" in message
    assert "http://b.test/v1 (InternalServerError" in message
    assert [s["in_rotation"] for s in client.server_stats()] == [False, True]


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 4.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7526e+09
vllm:spec_decode_num_drafts_created{engine="1",model_name="m"} 1.7526e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 12.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 6.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 3.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="0"} 1.75e9
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.9
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 300.0
vllm:generation_tokens_total{engine="1",model_name="m"} 100.0
# HELP vllm:request_generation_tokens Number of generation tokens processed.
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_sum{engine="0",model_name="m"} 999.0
vllm:request_generation_tokens_count{engine="0",model_name="m"} 9.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 6.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 6.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 3.0
vllm:e2e_request_latency_seconds_count{engine="1",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_sum{engine="1",model_name="m"} 1.0
# HELP vllm:e2e_request_latency_seconds_created Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds_created gauge
vllm:e2e_request_latency_seconds_created{engine="0",model_name="m"} 1.75e9
# HELP vllm:request_time_per_output_token_seconds Time per output token per request.
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 8.0
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="m"} 8.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="m"} 0.08
"""


def test_spec_decode_counters_sum_over_engines_and_skip_created_samples() -> None:
    counters = server_counters_from_metrics_text(METRICS).spec_decode
    assert counters == SpecDecodeCounters(14.0, 42.0, 21.0, [11.0, 7.0, 3.0])


def test_serving_counters_sum_over_labels() -> None:
    """Generated tokens and the latency histograms' sums and counts, summed over engines;
    another histogram's `_sum` (request_generation_tokens) and `_created` do not count."""
    serving = server_counters_from_metrics_text(METRICS).serving
    assert serving == ServingCounters(400.0, 4.0, 8.0, 0.08, 8.0)
    before = ServingCounters(100.0, 1.0, 2.0, 0.02, 2.0)
    delta = serving.minus(before)
    assert astuple(delta) == pytest.approx((300.0, 3.0, 6.0, 0.06, 6.0))


def test_one_scrape_differences_both_kinds_of_counter() -> None:
    counters = server_counters_from_metrics_text(METRICS)
    zero = server_counters_from_metrics_text("")
    assert counters.minus(zero) == counters
    assert counters.spec_decode == SpecDecodeCounters(14.0, 42.0, 21.0, [11.0, 7.0, 3.0])


def test_spec_decode_counters_without_a_draft_are_zero() -> None:
    text = METRICS.split("# HELP vllm:spec_decode")[0]
    counters = server_counters_from_metrics_text(text).spec_decode
    assert counters == SpecDecodeCounters(0.0, 0.0, 0.0, [])


def test_spec_decode_counters_difference() -> None:
    before = SpecDecodeCounters(4.0, 12.0, 6.0, [3.0, 2.0, 1.0])
    delta = server_counters_from_metrics_text(METRICS).spec_decode.minus(before)
    assert delta == SpecDecodeCounters(10.0, 30.0, 15.0, [8.0, 5.0, 2.0])


@pytest.fixture
def metrics_server() -> Iterator[str]:
    """A local HTTP server answering `/metrics` with METRICS; yields its `/v1` base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == "/metrics"
            body = METRICS.encode() if found else b"not found"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_spec_decode_counters_read_the_servers_metrics(metrics_server: str) -> None:
    expected = server_counters_from_metrics_text(METRICS)
    assert server_counters(metrics_server) == expected
    assert server_counters(metrics_server + "/") == expected
    # nothing more to wait for: the counters at once
    assert counters_after(metrics_server, expected, 0) == expected


def _managed(
    monkeypatch: pytest.MonkeyPatch,
    cuda: bool,
    image_root: Path | None = None,
    options: EngineOptions | None = None,
    serve_args: tuple[str, ...] = ("--seed", "0"),
) -> ManagedVllmServer:
    monkeypatch.setattr(vllm_server, "cuda_available", lambda: cuda)
    server = ManagedVllmServer(
        "/models/target", serve_args, image_root, Path("unused.log"), options or EngineOptions()
    )
    server.port = 8123
    return server


def _value(cmd: list[str], flag: str) -> str:
    assert flag in cmd, f"{flag} missing from {cmd}"
    return cmd[cmd.index(flag) + 1]


def test_command_on_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    options = EngineOptions(dtype="float32", max_model_len=4096, kv_cache_gib=2.0,
                            gpu_memory_utilization=0.5, extra_args=("--extra", "1"))  # fmt: skip
    cmd = _managed(monkeypatch, False, tmp_path, options).command()
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _value(cmd, "--model") == "/models/target"
    assert _value(cmd, "--host") == "127.0.0.1"
    assert _value(cmd, "--port") == "8123"
    assert _value(cmd, "--dtype") == "float32"
    assert _value(cmd, "--allowed-local-media-path") == str(tmp_path)
    assert _value(cmd, "--max-model-len") == "4096"
    assert "--enforce-eager" in cmd
    assert "--kv-cache-memory-bytes" not in cmd  # on CPU the environment sizes the cache
    assert "--gpu-memory-utilization" not in cmd
    seed = cmd.index("--seed")
    assert cmd[seed : seed + 2] == ["--seed", "0"]
    assert cmd[-2:] == ["--extra", "1"]


def test_command_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = _managed(monkeypatch, True, None, EngineOptions(kv_cache_gib=2.0)).command()
    assert "--enforce-eager" not in cmd
    assert "--max-model-len" not in cmd
    assert "--allowed-local-media-path" not in cmd
    assert _value(cmd, "--kv-cache-memory-bytes") == str(2 << 30)
    assert "--gpu-memory-utilization" not in cmd  # vLLM's own default
    forced = _managed(monkeypatch, True, options=EngineOptions(enforce_eager=True)).command()
    assert "--enforce-eager" in forced
    shared = EngineOptions(kv_cache_gib=None, gpu_memory_utilization=0.45)
    shared_cmd = _managed(monkeypatch, True, options=shared).command()
    assert _value(shared_cmd, "--gpu-memory-utilization") == "0.45"
    assert "--kv-cache-memory-bytes" not in shared_cmd


def test_command_without_eager_on_cpu_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = _managed(monkeypatch, False, options=EngineOptions(enforce_eager=False)).command()
    assert "--enforce-eager" not in cmd


def test_media_path_only_for_an_existing_image_root(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for root in (None, tmp_path / "missing"):
        assert "--allowed-local-media-path" not in _managed(monkeypatch, False, root).command()


def test_command_needs_a_port(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _managed(monkeypatch, False)
    server.port = None
    with pytest.raises(RuntimeError, match="no port"):
        server.command()


def test_environment_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_server, "cpu_preload", lambda: "/lib/tcmalloc.so:/venv/libiomp5.so")
    monkeypatch.setenv("LD_PRELOAD", "/lib/mine.so")
    env = _managed(monkeypatch, False, options=EngineOptions(kv_cache_gib=2.4)).environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["LD_PRELOAD"] == "/lib/tcmalloc.so:/venv/libiomp5.so:/lib/mine.so"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the worker in the engine core
    assert env["KMP_BLOCKTIME"] == "1"  # Intel OpenMP, preloaded: no 200 ms spin
    small = _managed(monkeypatch, False, options=EngineOptions(kv_cache_gib=0.3)).environment()
    assert small["VLLM_CPU_KVCACHE_SPACE"] == "1"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the user's choice stands
    monkeypatch.setenv("KMP_BLOCKTIME", "200")
    chosen = _managed(monkeypatch, False).environment()
    assert chosen["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and chosen["KMP_BLOCKTIME"] == "200"
    monkeypatch.delenv("KMP_BLOCKTIME")
    monkeypatch.setattr(vllm_server, "cpu_preload", lambda: None)  # no Intel OpenMP: no knob
    assert "KMP_BLOCKTIME" not in _managed(monkeypatch, False).environment()


def test_environment_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    env = _managed(monkeypatch, True, options=EngineOptions(kv_cache_gib=2.0)).environment()
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "LD_PRELOAD" not in env
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "KMP_BLOCKTIME" not in env


@pytest.mark.parametrize(
    ("connector", "cuda", "cpu_connector"),
    [("cpu", True, True), ("stock", False, False), ("auto", False, True), ("auto", True, False)],
)
def test_extraction_args(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, connector: str, cuda: bool, cpu_connector: bool
) -> None:
    monkeypatch.setattr(serve_args, "cuda_available", lambda: cuda)
    out = tmp_path / "incoming"
    args = extraction_args([2, 4, 7], out, connector)
    assert out.is_dir()
    assert args[0] == "--speculative-config" and args[2] == "--kv-transfer-config"
    speculative, transfer = json.loads(args[1]), json.loads(args[3])
    assert speculative["method"] == "extract_hidden_states"
    assert speculative["num_speculative_tokens"] == 1
    layers = speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert layers == [2, 4, 7]
    assert transfer["kv_role"] == "kv_producer"
    assert transfer["kv_connector_extra_config"] == {"shared_storage_path": str(out)}
    if cpu_connector:
        assert transfer["kv_connector"] == "CpuHiddenStatesConnector"
        module = transfer["kv_connector_module_path"]
        assert module == "mm_assets.clients.cpu_hidden_states_connector"
        assert importlib.util.find_spec(module) is not None
    else:
        assert transfer["kv_connector"] == "ExampleHiddenStatesConnector"
        assert "kv_connector_module_path" not in transfer


def test_speculative_decoding_args() -> None:
    flag, config, *metrics = speculative_decoding_args(Path("/drafts/d1"), 3)
    assert metrics == ["--per-request-spec-decode-metrics", "summary"]  # each reply its counts
    assert flag == "--speculative-config"
    assert json.loads(config) == {
        "model": "/drafts/d1",
        "method": "eagle3",
        "num_speculative_tokens": 3,
    }


class ScriptedServer(ManagedVllmServer):
    """A managed server whose process is a Python script standing in for vLLM."""

    def __init__(self, script: str, log_path: Path, startup_timeout_s: float) -> None:
        super().__init__("m", [], None, log_path, startup_timeout_s=startup_timeout_s)
        self.script = script

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script]

    def environment(self) -> dict[str, str]:
        return dict(os.environ)


def _wait_for_child(parent: psutil.Process, argv: list[str], within_s: float = 30.0) -> None:
    """Until `parent` has a child running `argv` (forked and exec'd)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for child in parent.children():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if child.cmdline()[: len(argv)] == argv:
                    return
        time.sleep(0.02)
    pytest.fail(f"{parent.pid} did not start {argv} within {within_s:.0f}s")


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether `pid` exits (or is left a zombie) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_startup_failure_reports_the_server_log(tmp_path: Path) -> None:
    script = "import sys; print('error: unrecognized arguments: --no-such-flag'); sys.exit(2)"
    server = ScriptedServer(script, tmp_path / "logs" / "vllm.log", startup_timeout_s=30)
    with pytest.raises(ServerStartupError) as info:
        server.start()
    message = str(info.value)
    assert "exited with code 2" in message
    assert "error: unrecognized arguments: --no-such-flag" in message
    assert str(server.log_path) in message
    assert server.process is not None and server.process.returncode == 2


ANSWERING_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
print("INFO loading the model", flush=True)
print("ERROR the KV cache is too small for one request", flush=True)
print("INFO serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class AnsweringServer(ScriptedServer):
    """A stand-in that answers `/health` on its port until it is killed."""

    def __init__(self, log_path: Path) -> None:
        super().__init__(ANSWERING_SERVER, log_path, startup_timeout_s=60)

    def command(self) -> list[str]:
        return [*super().command(), str(self.port)]


def test_a_managed_server_killed_mid_step_explains_itself(tmp_path: Path) -> None:
    """While the server runs, a step's errors pass as they are; once it is dead, the
    step's error quotes its exit status, the log's path and the log's error lines."""
    server = AnsweringServer(tmp_path / "logs" / "vllm.log")
    with server:
        assert server.exit_report(wait_s=0) is None
        with pytest.raises(ConnectionError), death_explained(server, "measuring d"):
            raise ConnectionError("refused")
        assert server.process is not None
        os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)
        with pytest.raises(ServerUnavailable) as info, death_explained(server, "measuring d"):
            raise ConnectionError("connection refused")
    message = str(info.value)
    assert "vLLM stopped answering while measuring d: connection refused" in message
    assert "exited with code -9, killed by SIGKILL" in message
    assert str(server.log_path) in message
    assert "ERROR the KV cache is too small" in message and "INFO serving" not in message


def _warm(log: Path, image_root: Path | None = None, *serve_args: str) -> AnsweringServer:
    server = AnsweringServer(log)
    server.keep_warm, server.image_root, server.serve_args = 1, image_root, list(serve_args)
    server.model = str(log.parent / "target")
    return server


def test_a_server_kept_warm_serves_the_next_step_that_serves_the_same(tmp_path: Path) -> None:
    """A step that ends well parks its server; the next one that serves the same target
    the same way takes it over (its log and image directory too: an image outside it goes
    inline); one serving otherwise, or the same files rewritten since, starts its own, and
    the oldest parked beyond the limit stops. A failed step stops its server; a parked
    server that died is not handed out."""
    images = [tmp_path / "images_a", tmp_path / "images_b"]
    for d in [*images, tmp_path / "target"]:
        d.mkdir()
    (tmp_path / "target" / "model.safetensors").write_bytes(b"weights")
    first = _warm(tmp_path / "a.log", images[0])
    try:
        with first:
            pid = first.process.pid
        assert first.process is None and len(warm_servers.parked()) == 1 and not _gone(pid, 0.5)
        second = _warm(tmp_path / "b.log", images[1])
        with second:
            assert second.reused and second.process.pid == pid
            assert second.log_path == tmp_path / "a.log" and not (tmp_path / "b.log").exists()
            assert second.access.media_dir == images[0]
        (tmp_path / "target" / "model.safetensors").write_bytes(b"retrained weights")
        retrained = _warm(tmp_path / "r.log")
        with retrained:
            assert not retrained.reused and retrained.process.pid != pid
        assert _gone(pid) and len(warm_servers.parked()) == 1
        pid = warm_servers.parked()[0].process.pid
        other = _warm(tmp_path / "c.log", None, "--speculative-config", "{}")
        with other:
            assert not other.reused and other.process.pid != pid
            other_pid = other.process.pid
        assert _gone(pid) and len(warm_servers.parked()) == 1  # the limit: one
        failing = _warm(tmp_path / "d.log", None, "--speculative-config", "{}")
        with pytest.raises(RuntimeError), failing:
            assert failing.reused
            raise RuntimeError("the step failed")
        assert _gone(other_pid) and len(warm_servers.parked()) == 0
        again = _warm(tmp_path / "e.log")
        with again:
            dead = again.process.pid
        os.killpg(dead, signal.SIGKILL)
        assert _gone(dead)
        fresh = _warm(tmp_path / "f.log")
        with fresh:
            assert not fresh.reused and fresh.process.pid != dead
            assert fresh.log_path == tmp_path / "f.log"
    finally:
        warm_servers.stop_all()
    assert len(warm_servers.parked()) == 0


def test_weights_rewritten_while_a_server_serves_never_reach_a_later_step(tmp_path: Path) -> None:
    """The server loaded the files as they were when it started: parked after the draft
    was retrained under it, it must not serve the next step, which asks for the new ones."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "model.safetensors").write_bytes(b"weights")
    try:
        serving = _warm(tmp_path / "a.log")
        with serving:
            pid = serving.process.pid
            (tmp_path / "target" / "model.safetensors").write_bytes(b"retrained weights")
        assert len(warm_servers.parked()) == 1
        after = _warm(tmp_path / "b.log")
        with after:
            assert not after.reused and after.process.pid != pid
    finally:
        warm_servers.stop_all()


def test_on_a_gpu_parked_servers_stop_before_another_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One server holds a GPU: a start that takes no parked server stops them first."""
    monkeypatch.setattr(vllm_server, "cuda_available", lambda: True)
    (tmp_path / "target").mkdir()
    try:
        first = _warm(tmp_path / "a.log")
        with first:
            pid = first.process.pid
        assert len(warm_servers.parked()) == 1 and not _gone(pid, 0.5)
        other = _warm(tmp_path / "b.log", None, "--speculative-config", "{}")
        other.keep_warm = 2  # room for both: only the GPU rule stops the first
        with other:
            assert _gone(pid) and warm_servers.parked() == []
    finally:
        warm_servers.stop_all()


def test_parked_servers_beyond_the_limit_stop_oldest_first() -> None:
    stopped: list[str] = []

    class Idle:
        def __init__(self, name: str) -> None:
            self.name = name

        def stop(self) -> None:
            stopped.append(self.name)

    try:
        warm_servers.park("plain", Idle("plain 1"), limit=2)
        warm_servers.park("draft", Idle("draft"), limit=2)
        warm_servers.park("plain", Idle("plain 2"), limit=2)
        assert stopped == ["plain 1"]
        taken = warm_servers.take("plain")
        assert isinstance(taken, Idle) and taken.name == "plain 2"
        assert warm_servers.take("plain") is None and len(warm_servers.parked()) == 1
    finally:
        warm_servers.stop_all()
    assert stopped == ["plain 1", "draft"]


WORKER = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)
# The stand-in's API process, like vLLM's (which installs its own handler), ends on
# SIGTERM even when it inherits SIGTERM blocked from the test process (seen once in a
# full run: the stop then waited out its 20 s grace before SIGKILL).
HANGING_SERVER = f"""
import signal, subprocess, sys, time
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGTERM}})
signal.signal(signal.SIGTERM, signal.SIG_DFL)
worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}], stdout=subprocess.PIPE)
worker.stdout.readline()
print(f"worker {{worker.pid}}", flush=True)
time.sleep(60)
"""


class HangingServer(ScriptedServer):
    """HANGING_SERVER, whose start-up clock starts once its worker runs, so the timeout
    under test cannot fire before there is a worker to stop."""

    def __init__(self, log_path: Path, startup_timeout_s: float) -> None:
        super().__init__(HANGING_SERVER, log_path, startup_timeout_s)

    def _wait_until_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + 60
        while not any(ln.startswith("worker ") for ln in self.log_tail().splitlines()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the stand-in never started its worker; log:\n{self.log_tail()}")
            time.sleep(0.02)
        super()._wait_until_healthy()


def test_startup_timeout_kills_the_process_group(tmp_path: Path) -> None:
    """A server that never answers `/health` is stopped with every process it started,
    a worker that ignores SIGTERM included."""
    server = HangingServer(tmp_path / "vllm.log", startup_timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(ServerStartupError, match="did not become healthy"):
        server.start()
    assert time.monotonic() - started < 15
    assert server.process is not None and server.process.poll() is not None
    worker_lines = [ln for ln in server.log_tail().splitlines() if ln.startswith("worker ")]
    assert worker_lines, f"the stand-in never started its worker; log:\n{server.log_tail()}"
    assert _gone(int(worker_lines[0].split()[1]))


RSS_TREE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c",
    "x = b'x' * 60_000_000; print('ready', flush=True); import time; time.sleep(30)"])
time.sleep(30)
"""


def test_rss_bytes_counts_the_process_tree(tmp_path: Path) -> None:
    server = ManagedVllmServer("m", [], None, tmp_path / "vllm.log")
    assert server.rss_bytes() == 0
    process = subprocess.Popen(
        [sys.executable, "-c", RSS_TREE], stdout=subprocess.PIPE, start_new_session=True
    )
    server.process = process
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
        assert psutil.Process(process.pid).memory_info().rss < 60_000_000
        assert server.rss_bytes() >= 60_000_000
    finally:
        server.stop(grace_s=5)
        assert process.stdout is not None
        process.stdout.close()
    assert server.rss_bytes() == 0


def test_a_guarded_command_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    """The managed server's guard: when the process that started it is SIGKILLed (its
    stop() never runs), the command and its children end too; the server runs in its
    own session, so nothing else would stop it."""
    starter = subprocess.Popen(
        [
            sys.executable, "-c",
            "import os, subprocess, sys, time\n"
            "guard = subprocess.Popen([sys.executable, '-m', 'mm_assets.clients.parent_guard',"
            " str(os.getpid()), '--', 'sleep', '600'], start_new_session=True,"
            " stdout=subprocess.DEVNULL)\n"
            "print(guard.pid, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert starter.stdout is not None
    with starter.stdout:
        guard = psutil.Process(int(starter.stdout.readline()))
    _wait_for_child(guard, ["sleep", "600"])
    (sleeper,) = guard.children()
    assert sleeper.cmdline()[:2] == ["sleep", "600"]
    starter.kill()
    starter.wait()
    _, alive = psutil.wait_procs([guard, sleeper], timeout=15)
    assert not alive


# Starts a child that stays in its process group (as vLLM's API process starts its
# EngineCore), says its pid, then sleeps until it is killed.
LEAVES_A_CHILD = (
    "import subprocess, time; child = subprocess.Popen(['sleep', '600']); "
    "print(child.pid, flush=True); time.sleep(600)"
)


@contextlib.contextmanager
def _guarded_tree() -> Iterator[tuple[subprocess.Popen, psutil.Process, int]]:
    """A guard (in its own session, as the managed server's) running `LEAVES_A_CHILD`:
    the guard, its command, and the pid of the command's child; all killed afterwards."""
    guard = subprocess.Popen(
        [sys.executable, "-m", "mm_assets.clients.parent_guard", str(os.getpid()), "--",
         sys.executable, "-c", LEAVES_A_CHILD],
        stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert guard.stdout is not None
    with guard.stdout:
        grandchild = int(guard.stdout.readline())
    (command,) = psutil.Process(guard.pid).children()
    tree = [psutil.Process(guard.pid), command, psutil.Process(grandchild)]
    try:
        yield guard, command, grandchild
    finally:
        for process in tree:  # psutil signals none whose pid was reused
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        guard.wait()


def test_a_guard_whose_command_is_killed_ends_what_the_command_left() -> None:
    """vLLM's API process killed outright (the OOM killer's pick) leaves its EngineCore,
    which would keep its memory for good: the guard ends its whole group."""
    with _guarded_tree() as (guard, command, grandchild):
        command.kill()  # the grandchild may ignore SIGTERM (inherited): then the grace runs out
        assert guard.wait(timeout=parent_guard.GRACE_S + 10) == 128 + signal.SIGKILL
        assert _gone(grandchild)


def test_a_servers_stop_ends_its_group_when_the_guard_is_gone(tmp_path: Path) -> None:
    """The step's own stop ends the server's whole group, also when its guard was killed
    before it could."""
    server = ManagedVllmServer("m", [], None, tmp_path / "vllm.log")
    with _guarded_tree() as (guard, command, grandchild):
        server.process = guard
        guard.send_signal(signal.SIGKILL)
        assert _gone(guard.pid)
        server.stop(grace_s=2)
        assert _gone(command.pid) and _gone(grandchild)


def test_a_guarded_command_reports_its_exit_status() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mm_assets.clients.parent_guard", str(os.getpid()), "--",
         sys.executable, "-c", "raise SystemExit(3)"],
        check=False,
    )  # fmt: skip
    assert done.returncode == 3


def test_the_managed_server_gets_only_the_variables_it_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cloud credentials, API keys and tokens stay with the caller; what Python, vLLM and
    the runtimes read, and the run marker the dead-run watch looks for, go along."""
    secrets = {
        "AWS_SECRET_ACCESS_KEY": "aws", "MM_ASSETS_VLLM_API_KEY": "mine", "HF_TOKEN": "hf",
        "VLLM_API_KEY": "server", "GOOGLE_APPLICATION_CREDENTIALS": "/k.json", "PGPASSWORD": "pg",
    }  # fmt: skip
    needed = {"PATH": "/bin", "VLLM_LOGGING_LEVEL": "DEBUG", "MM_ASSETS_RUN_ID": "run-1",
              "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "LC_ALL": "C.UTF-8"}  # fmt: skip
    for name, value in {**secrets, **needed}.items():
        monkeypatch.setenv(name, value)
    env = _managed(monkeypatch, True).environment()
    assert not set(secrets) & set(env)
    assert {name: env[name] for name in needed} == needed


def test_a_variable_holding_a_url_with_a_password_stays_with_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever its name: a password in a URL is a credential like a key."""
    monkeypatch.setenv("VLLM_PLUGIN_INDEX", "https://user:pw-s3cret@index.example/simple")
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/etc/vllm/logging.json")
    env = _managed(monkeypatch, True).environment()
    assert "VLLM_PLUGIN_INDEX" not in env
    assert env["VLLM_LOGGING_CONFIG_PATH"] == "/etc/vllm/logging.json"


def test_a_replys_own_metrics_become_its_acceptance_counts() -> None:
    from mm_assets.clients.vllm_generation import ReplyMetrics, reply_metrics

    spec = {
        "acceptance_histogram": [2, 1, 0, 3],  # verifications accepting exactly j tokens
        "num_accepted_draft_tokens": 10,
        "num_spec_steps": 6,
        "num_draft_tokens": 18,
    }
    found = reply_metrics({"generation_time_ms": 250.0, "speculative_decoding": spec}, 0.3)
    assert found == ReplyMetrics(0.3, 0.25, (4, 3, 3), 6, 10)
    assert reply_metrics(None, 0.3) == ReplyMetrics(0.3)
    assert reply_metrics({"generation_time_ms": None}, 0.3) == ReplyMetrics(0.3)


@pytest.mark.parametrize(
    "reported",
    [
        "fast",
        {"generation_time_ms": -1},
        {"generation_time_ms": float("inf")},
        {"speculative_decoding": {"acceptance_histogram": [1, -2], "num_accepted_draft_tokens": 0}},
        {"speculative_decoding": {"acceptance_histogram": [1, 2], "num_accepted_draft_tokens": 9}},
        {
            "speculative_decoding": {
                "acceptance_histogram": [0.5, 1],
                "num_accepted_draft_tokens": 1,
            }
        },
        {
            "speculative_decoding": {
                "acceptance_histogram": [1] * 70,
                "num_accepted_draft_tokens": sum(range(70)),
            }
        },
        {"speculative_decoding": {"acceptance_histogram": []}},
        {
            "speculative_decoding": {
                "acceptance_histogram": {"1": 2},
                "num_accepted_draft_tokens": 2,
            }
        },
        {"speculative_decoding": "all accepted"},
    ],
)
def test_a_reply_whose_metrics_are_not_counts_is_refused(reported: object) -> None:
    """A server's figures enter means: one that is not a count refuses its request."""
    from mm_assets.clients.vllm_generation import reply_metrics

    with pytest.raises(RequestRefused):
        reply_metrics(reported, 0.3)
