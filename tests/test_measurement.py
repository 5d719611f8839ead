"""Which held-out replies vLLM is asked to generate, and the estimate set beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from mm_assets.services.measurement import HeldOutReply, held_out_replies, same_as_target
from mm_assets.storage import TableStore

TURNS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("turns", pa.string()),
        ("reply_turns", pa.list_(pa.int32())),
        ("reply_token_ids", pa.list_(pa.list_(pa.int32()))),
    ]
)


def _conversation(*replies: str) -> str:
    turns = [{"role": "user", "content": [{"type": "image", "path": "/i/a.png"}]}]
    for number, reply in enumerate(replies):
        turns += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"q{number}"},
        ]
    return json.dumps(turns[:-1])


def test_held_out_replies_pair_each_replayed_reply_with_its_prompt(tmp_path: Path) -> None:
    """A whole row's replies, a per-turn row's one reply, in the replay's order; a reply
    truncated out of its row (no replay) is not asked for; `limit` caps the prompts."""
    tables = TableStore(tmp_path)
    rows = [
        {"sample_id": "a", "turns": _conversation("a1", "a2", "a3"), "reply_turns": None},
        {
            "sample_id": "b",
            "turns": _conversation("b1", "b2"),
            "reply_turns": [1, 3],
            "reply_token_ids": [[5, 6], [7, 8, 9]],
        },
    ]
    tables.write("target_responses", "p", rows, TURNS)
    replayed = {"b/turn3": [[1, 0]], "a": [[2], [0, 0]]}  # a's third reply was truncated
    replies = held_out_replies(tables, "p", replayed, limit=10)
    assert [(r.row_id, r.reply) for r in replies] == [("b/turn3", 0), ("a", 0), ("a", 1)]
    b_prompt, a_second = replies[0].prompt, replies[2].prompt
    assert [m["content"] for m in b_prompt[1:]] == ["b1", "q0"]
    assert b_prompt[0]["content"] == [
        {"type": "image_url", "image_url": {"url": "file:///i/a.png"}}
    ]
    assert [m["content"] for m in a_second[1:]] == ["a1", "q0"]
    assert len(held_out_replies(tables, "p", replayed, limit=2)) == 2
    # the target's own reply to b's prompt rides along; a's replies are the dataset's
    assert replies[0].target_ids == [7, 8, 9] and replies[1].target_ids is None


def test_generations_compare_with_the_targets_replies_over_their_common_length() -> None:
    b = HeldOutReply("b", 0, [], [7, 8, 9])
    assert same_as_target([b], [[7, 8]]) == 1  # generated fewer tokens (max_tokens)
    assert same_as_target([b], [[7, 8, 9, 4]]) == 1  # the target's reply was cut shorter
    assert same_as_target([b], [[7, 5, 9]]) == 0
    assert same_as_target([HeldOutReply("a", 0, [], None)], [[1]]) is None
