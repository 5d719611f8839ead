"""On-policy responses without a server: prompts per turn, the content key, the system
prompt policy, what is kept when a turn fails, and the turn-by-turn loop against a
scripted OpenAI-compatible transport."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from mm_assets.clients.media_urls import ServerAccess
from mm_assets.clients.vllm_generation import ChatClient
from mm_assets.domain.model.responses import (
    Regeneration,
    Reply,
    ResponseProblem,
    ResponseRejected,
    ResponseSettings,
    prompt_before,
    refusal_problem,
    regenerated_turns,
    response_key,
    with_system_prompt,
)
from mm_assets.services.regeneration import regenerate

IMAGE = {"type": "image", "path": "/coco/a.jpg"}
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [IMAGE, {"type": "text", "text": "What is this?"}]},
    {"role": "assistant", "content": "A dataset answer."},
    {"role": "user", "content": "And the colour?"},
    {"role": "assistant", "content": "Another dataset answer."},
]


def _reply(index: int, text: str) -> Reply:
    return Reply(index, text, [1, 2, 3], "stop")


def test_each_prompt_holds_the_targets_earlier_replies_and_the_users_turns() -> None:
    first = prompt_before(TURNS, 2, [])
    assert first == TURNS[:2]
    second = prompt_before(TURNS, 4, [_reply(2, "Target's first.")])
    assert [t["role"] for t in second] == ["system", "user", "assistant", "user"]
    assert second[2]["content"] == "Target's first." and second[3] == TURNS[3]


def test_the_key_follows_the_prompt_side_not_the_dataset_answers() -> None:
    settings = ResponseSettings()
    key = response_key("target", "float32", settings, TURNS, ["sha-a"])
    other_answers = [*TURNS[:2], {"role": "assistant", "content": "x"}, *TURNS[3:]]
    assert response_key("target", "float32", settings, other_answers, ["sha-a"]) == key
    assert response_key("target", "float32", settings, TURNS, ["sha-b"]) != key  # other image bytes
    assert response_key("other", "float32", settings, TURNS, ["sha-a"]) != key
    assert (
        response_key("target", "float32", ResponseSettings(max_tokens=8), TURNS, ["sha-a"]) != key
    )
    assert response_key("target", "bfloat16", settings, TURNS, ["sha-a"]) != key  # numerics
    edited = [*TURNS[:3], {"role": "user", "content": "And the size?"}, TURNS[4]]
    assert response_key("target", "float32", settings, edited, ["sha-a"]) != key


@pytest.mark.parametrize(
    ("policy", "first"),
    [(None, "Be brief."), ("You are a tutor.", "You are a tutor."), ("", None)],
)
def test_system_prompt_policy(policy, first) -> None:
    turns = with_system_prompt(TURNS, policy)
    system = [t["content"] for t in turns if t["role"] == "system"]
    assert system == ([first] if first else [])
    assert [t for t in turns if t["role"] != "system"] == TURNS[1:]


def test_a_later_failure_keeps_the_answered_exchanges_and_a_first_one_quarantines() -> None:
    answered = Regeneration([_reply(2, "Target's first.")], ResponseProblem.EMPTY_RESPONSE)
    kept = regenerated_turns(TURNS, answered)
    assert len(kept) == 3 and kept[-1] == {"role": "assistant", "content": "Target's first."}
    with pytest.raises(ResponseRejected) as info:
        regenerated_turns(TURNS, Regeneration([], ResponseProblem.PROMPT_TOO_LONG, "turn 2"))
    assert info.value.reason == ResponseProblem.PROMPT_TOO_LONG


def test_refusals_are_told_apart() -> None:
    too_long = "This model's maximum context length is 4096 tokens. However, you requested 5000"
    assert refusal_problem(400, too_long) == ResponseProblem.PROMPT_TOO_LONG
    assert refusal_problem(400, "invalid image") == ResponseProblem.GENERATION_ERROR
    assert refusal_problem(None, "gave up after 5 tries") == ResponseProblem.GENERATION_ERROR


def test_stored_form_round_trips() -> None:
    original = Regeneration([_reply(2, "a"), _reply(4, "b")], ResponseProblem.EMPTY_RESPONSE, "x")
    assert Regeneration.from_json(json.loads(json.dumps(original.as_json()))) == original


class ScriptedChat:
    """An OpenAI-compatible transport answering chat requests from a script, and
    recording the messages of each."""

    def __init__(self, replies: list[str | int | tuple[str, str]]) -> None:
        self.replies, self.seen = list(replies), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            model = {"id": "m", "object": "model", "created": 0, "owned_by": "x"}
            return httpx.Response(200, json={"object": "list", "data": [model]})
        body = json.loads(request.content)
        self.seen.append(body)
        reply = self.replies.pop(0)
        if isinstance(reply, int):
            message = "This model's maximum context length is 64 tokens. However, you requested 80"
            return httpx.Response(reply, json={"error": {"message": message}})
        text, finish = reply if isinstance(reply, tuple) else (reply, "stop")
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": finish, "token_ids": [7, 8]}
        payload = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                   "choices": [choice]}  # fmt: skip
        return httpx.Response(200, json=payload)


def _regenerate(script: ScriptedChat, turns: list[dict]) -> Regeneration:
    client = ChatClient(
        ["http://vllm.test/v1"],
        access=ServerAccess("k", Path("/coco")),  # the turns' images lie there
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(script)),
        backoff_s=0.001,
    )

    async def main() -> Regeneration:
        try:
            return await regenerate(client, turns, ResponseSettings(max_tokens=16))
        finally:
            await client.close()

    return asyncio.run(main())


def test_turns_are_asked_in_order_with_the_earlier_replies() -> None:
    script = ScriptedChat(["First reply.", "Second reply."])
    result = _regenerate(script, TURNS)
    assert [r.text for r in result.replies] == ["First reply.", "Second reply."]
    assert result.problem is None and result.replies[0].token_ids == [7, 8]
    first, second = script.seen
    assert first["max_tokens"] == 16 and first["temperature"] == 0.0
    assert first["return_token_ids"] is True
    image = first["messages"][1]["content"][0]
    assert image == {"type": "image_url", "image_url": {"url": "file:///coco/a.jpg"}}
    assert second["messages"][2] == {"role": "assistant", "content": "First reply."}
    assert len(second["messages"]) == 4


@pytest.mark.parametrize(
    ("script", "problem", "kept"),
    [
        (["  \n"], ResponseProblem.EMPTY_RESPONSE, 0),
        (["First reply.", ""], ResponseProblem.EMPTY_RESPONSE, 1),
        ([400], ResponseProblem.PROMPT_TOO_LONG, 0),
        ([("", "length"), "Second reply."], None, 2),  # byte pieces cut before they decode
    ],
    ids=["empty-first", "empty-second", "refused", "undecoded-at-the-cap"],
)
def test_the_loop_stops_at_the_first_unusable_reply(script, problem, kept) -> None:
    result = _regenerate(ScriptedChat(script), TURNS)
    assert result.problem == problem and len(result.replies) == kept
