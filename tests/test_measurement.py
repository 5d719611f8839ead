"""Which held-out replies vLLM is asked to generate, and the estimate set beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from mm_assets.domain.model.benchmark import Generation
from mm_assets.services.measurement import HeldOutReply, held_out_replies, same_as_target
from mm_assets.storage import TableStore

TURNS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("turns", pa.string()),
        ("reply_turns", pa.list_(pa.int32())),
        ("reply_token_ids", pa.list_(pa.list_(pa.int32()))),
        ("finish_reasons", pa.list_(pa.string())),
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
            "finish_reasons": ["stop", "length"],
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
    assert replies[0].target == Generation([7, 8, 9], cut=True) and replies[1].target is None


def test_generations_are_the_targets_replies_up_to_where_max_tokens_cut_either() -> None:
    cut = HeldOutReply("b", 0, [], Generation([7, 8, 9], cut=True))
    ended = HeldOutReply("c", 0, [], Generation([7, 8, 9], cut=False))
    assert same_as_target([cut], [[7, 8]], max_tokens=2) == 1  # we generated fewer tokens
    assert same_as_target([cut], [[7, 8, 9, 4]], max_tokens=8) == 1  # the target's was cut
    assert same_as_target([ended], [[7, 8, 9, 4]], max_tokens=8) == 0  # it ended, we went on
    assert same_as_target([ended], [[7, 8, 9]], max_tokens=8) == 1
    assert same_as_target([cut], [[7, 5, 9]], max_tokens=3) == 0
    assert same_as_target([HeldOutReply("a", 0, [], None)], [[1]], max_tokens=1) is None


def test_a_draft_of_several_sources_resamples_its_prompts_within_each_source() -> None:
    """Each source's share of the held-out prompts is the draft's design, not a draw: a
    resample that took more of the easy source would widen the interval for nothing."""
    from mm_assets.domain.model.acceptance import Acceptance
    from mm_assets.domain.model.intervals import ratio_interval
    from mm_assets.services.measurement import Measurement

    easy = Measurement(Acceptance(), per_prompt=[(10, 7 + i % 4) for i in range(20)])
    hard = Measurement(Acceptance(), per_prompt=[(10, i % 4) for i in range(6)])
    both = Measurement.combined({"easy": easy, "hard": hard})
    assert both.sources == ["easy"] * 20 + ["hard"] * 6
    drafts, accepted = zip(*both.per_prompt, strict=True)
    pooled = ratio_interval(accepted, drafts, offset=1.0)
    assert both.interval is not None and pooled is not None
    assert both.interval.value == pytest.approx(pooled.value)
    assert both.interval.high - both.interval.low < (pooled.high - pooled.low) / 2
