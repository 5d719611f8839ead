"""Which held-out replies vLLM is asked to generate, and the estimate set beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from mm_assets.services.measurement import held_out_replies
from mm_assets.storage import TableStore

TURNS = pa.schema([("sample_id", pa.string()), ("turns", pa.string())])


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
        {"sample_id": "a", "turns": _conversation("a1", "a2", "a3")},
        {"sample_id": "b", "turns": _conversation("b1", "b2")},
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
