"""Normalization of the supported formats and the reason for every drop."""

from __future__ import annotations

import json

import pytest

from mm_assets.domain.ingest.images import ImageProbe, ImageStatus
from mm_assets.domain.prep.conversations import (
    DropReason,
    Rejected,
    image_references,
    normalize,
    parse_record,
    reply_indices,
    reply_prompts,
    to_vllm_messages,
)
from mm_assets.domain.row_ids import make_row_id, turn_index_of
from mm_assets.registry.specs import DatasetSpec, PromptColumns


def _ok(ref: str, digest: str = "h1") -> ImageProbe:
    return ImageProbe(
        ref, f"/data/coco/{ref}", ImageStatus.OK, width=64, height=48, content_hash=digest
    )


PROBES = {
    "coco/a.jpg": _ok("coco/a.jpg"),
    "coco/b.jpg": _ok("coco/b.jpg", "h2"),
    "coco/gone.jpg": ImageProbe("coco/gone.jpg", "/data/coco/gone.jpg", ImageStatus.MISSING),
}


def _v4(image, *turns):
    return {"image": image, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt4v_image_line_becomes_an_image_part() -> None:
    conv = normalize(
        _v4("coco/a.jpg", ("human", "<image>\nWhat is this?"), ("gpt", "A cat.")),
        "sharegpt4v",
        PROBES,
    )
    assert conv.turns == [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": "/data/coco/coco/a.jpg", "sha256": "h1"},
                {"type": "text", "text": "What is this?"},
            ],
        },
        {"role": "assistant", "content": "A cat."},
    ]
    assert conv.multimodal and conv.images[0].content_hash == "h1"


def test_placeholder_after_text_and_list_of_images() -> None:
    conv = normalize(
        _v4(
            ["coco/a.jpg", "coco/b.jpg"], ("human", "Compare\n<image>\nand <image>"), ("gpt", "ok")
        ),
        "sharegpt4v",
        PROBES,
    )
    parts = conv.turns[0]["content"]
    assert [p["type"] for p in parts] == ["text", "image", "text", "image"]
    assert parts[0]["text"] == "Compare" and parts[2]["text"] == "and "


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (
            _v4("coco/gone.jpg", ("human", "<image>\nhi"), ("gpt", "x")),
            DropReason.IMAGE_UNAVAILABLE,
        ),
        (
            _v4("coco/unknown.jpg", ("human", "<image>\nhi"), ("gpt", "x")),
            DropReason.IMAGE_UNAVAILABLE,
        ),
        (
            _v4("coco/a.jpg", ("human", "<image>\n<image>\nhi"), ("gpt", "x")),
            DropReason.IMAGE_PLACEHOLDER_MISMATCH,
        ),
        (_v4("coco/a.jpg", ("human", "hi"), ("gpt", "x")), DropReason.IMAGE_PLACEHOLDER_MISMATCH),
        (_v4(None, ("human", "<image>\nhi"), ("gpt", "x")), DropReason.IMAGE_PLACEHOLDER_MISMATCH),
        (
            _v4("coco/a.jpg", ("human", "hi"), ("gpt", "<image>")),
            DropReason.IMAGE_PLACEHOLDER_MISMATCH,
        ),
        (_v4(None, ("human", "hi"), ("human", "again")), DropReason.NO_ASSISTANT_TURN),
        (_v4(None, ("gpt", "Hello."), ("human", "hi")), DropReason.NO_ASSISTANT_TURN),
        (_v4(None), DropReason.EMPTY_CONVERSATION),
        ({"image": None, "conversations": "human: hi"}, DropReason.MALFORMED_ROW),
        ({"conversations": [{"from": "human"}]}, DropReason.MALFORMED_ROW),
        (_v4(None, ("narrator", "once"), ("gpt", "x")), DropReason.UNKNOWN_ROLE),
        (_v4(None, ("human", "hi"), ("gpt", "")), DropReason.EMPTY_ASSISTANT_TURN),
        (
            _v4(None, ("human", "hi"), ("gpt", " \n\t"), ("human", "?"), ("gpt", "x")),
            DropReason.EMPTY_ASSISTANT_TURN,
        ),
    ],
)
def test_bad_records_are_rejected_with_their_reason(record, reason) -> None:
    with pytest.raises(Rejected) as info:
        normalize(record, "sharegpt4v", PROBES)
    assert info.value.reason is reason


def test_sharegpt_maps_roles_and_keeps_text_placeholders() -> None:
    record = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "What is <image> in HTML?"},
            {"from": "gpt", "value": "A tag."},
        ]
    }
    conv = normalize(record, "sharegpt", {})
    assert [t["role"] for t in conv.turns] == ["system", "user", "assistant"]
    assert conv.turns[1]["content"] == "What is <image> in HTML?" and not conv.multimodal


def test_assistant_turns_before_the_first_question_are_context_not_replies() -> None:
    """A dump scraped mid-conversation opens with an answer to no question in the row:
    it stays in the conversation the target reads, but is no reply to train on."""
    record = {
        "conversations": [
            {"from": "gpt", "value": "...so that is the first half."},
            {"from": "system", "value": "Be brief."},
            {"from": "gpt", "value": "Anything else?"},
            {"from": "human", "value": "And the second?"},
            {"from": "gpt", "value": "It rhymes."},
        ]
    }
    conv = normalize(record, "sharegpt", {})
    assert [t["role"] for t in conv.turns] == [
        "assistant", "system", "assistant", "user", "assistant",
    ]  # fmt: skip
    assert reply_indices(conv.turns) == [4]
    assert reply_prompts(conv.turns) == [(4, conv.turns[:4])]


def test_messages_format_with_image_parts() -> None:
    record = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "coco/a.jpg"},
                    {"type": "text", "text": "?"},
                ],
            },
            {"role": "assistant", "content": "A cat."},
        ]
    }
    assert image_references(record, "messages") == ["coco/a.jpg"]
    conv = normalize(record, "messages", PROBES)
    assert conv.turns[0]["content"][0] == {
        "type": "image",
        "path": "/data/coco/coco/a.jpg",
        "sha256": "h1",
    }


def test_parse_record_rejects_non_objects_and_bad_json() -> None:
    for text in ("[1, 2]", "{not json", '"a string"'):
        with pytest.raises(Rejected) as info:
            parse_record(text)
        assert info.value.reason is DropReason.MALFORMED_ROW
    with pytest.raises(Rejected):
        parse_record("whatever", parse_error="invalid JSON: line 3")


def test_sample_id_is_stable_and_follows_image_content_not_path() -> None:
    record = _v4("coco/a.jpg", ("human", "<image>\nWhat?"), ("gpt", "A cat."))
    a = normalize(record, "sharegpt4v", PROBES).sample_id()
    moved = {
        "coco/a.jpg": ImageProbe(
            "coco/a.jpg", "/elsewhere/a.jpg", ImageStatus.OK, content_hash="h1"
        )
    }
    assert normalize(record, "sharegpt4v", moved).sample_id() == a
    other = {"coco/a.jpg": _ok("coco/a.jpg", "different-bytes")}
    assert normalize(record, "sharegpt4v", other).sample_id() != a


def test_vllm_messages_use_file_urls_never_pixels() -> None:
    conv = normalize(
        _v4("coco/a.jpg", ("human", "<image>\nWhat?"), ("gpt", "A cat.")), "sharegpt4v", PROBES
    )
    messages = to_vllm_messages(conv.turns)
    assert messages[0]["content"][0] == {
        "type": "image_url",
        "image_url": {"url": "file:///data/coco/coco/a.jpg#sha256=h1"},
    }
    assert messages[1] == {"role": "assistant", "content": "A cat."}
    json.dumps(messages)  # serializable as stored


def test_reply_prompts_follow_the_rows_replies() -> None:
    """A whole-conversation row answers every assistant turn, in order; a per-turn row
    (`<sample>/turn<k>`) only turn k. Each prompt keeps earlier replies as stored."""
    turns = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert reply_prompts(turns) == [(2, turns[:2]), (4, turns[:4])]
    assert reply_prompts(turns, turn_index_of("s1/turn4")) == [(4, turns[:4])]
    assert turn_index_of("s1") is None and turn_index_of(make_row_id("s1", 2)) == 2
    # an opening assistant turn answers no question: context for the replies, not one
    assert reply_prompts([turns[2], *turns[3:]]) == [(2, turns[2:4])]


def test_an_empty_assistant_turn_in_parts_is_rejected_too() -> None:
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "  "}]},
        ]
    }
    with pytest.raises(Rejected, match="turn 1 has no text") as info:
        normalize(record, "messages", {})
    assert info.value.reason is DropReason.EMPTY_ASSISTANT_TURN


# -- TRL's layout: `{"type": "image"}` parts and an `images` column ---------------


def _trl(images, *content_of_turns):
    """A hub-style TRL record: every part holds every key of the dataset's struct."""
    roles = ["user", "assistant"] * len(content_of_turns)
    messages = []
    for role, content in zip(roles, content_of_turns, strict=False):
        if isinstance(content, list):
            content = [{"index": None, "text": None, "image": None, **part} for part in content]
        messages.append({"role": role, "content": content})
    return {"messages": messages, "images": images}


IMAGE_SLOT = {"type": "image", "index": 0}


def test_trl_image_parts_take_the_images_column_in_order() -> None:
    record = _trl(
        ["coco/a.jpg", "coco/b.jpg"],
        [IMAGE_SLOT, {"type": "text", "text": "Compare with"}, {**IMAGE_SLOT, "index": 1}],
        [{"type": "text", "text": "Same cat."}],
    )
    assert image_references(record, "messages") == ["coco/a.jpg", "coco/b.jpg"]
    conv = normalize(record, "messages", PROBES)
    assert conv.turns[0]["content"] == [
        {"type": "image", "path": "/data/coco/coco/a.jpg", "sha256": "h1"},
        {"type": "text", "text": "Compare with"},
        {"type": "image", "path": "/data/coco/coco/b.jpg", "sha256": "h2"},
    ]
    assert conv.turns[1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "Same cat."}],
    }
    assert [p.content_hash for p in conv.images] == ["h1", "h2"]


def test_trl_inline_references_and_column_images_mix_in_part_order() -> None:
    """A part with its own reference keeps it (a None `image` key does not hide a
    `path`); the parts without one take the column's images."""
    record = _trl(
        ["coco/b.jpg"],
        [{"type": "image", "path": "coco/a.jpg"}, IMAGE_SLOT, {"type": "text", "text": "?"}],
        "Two cats.",
    )
    assert image_references(record, "messages") == ["coco/a.jpg", "coco/b.jpg"]
    conv = normalize(record, "messages", PROBES)
    paths = [p["path"] for p in conv.turns[0]["content"] if p["type"] == "image"]
    assert paths == ["/data/coco/coco/a.jpg", "/data/coco/coco/b.jpg"]


@pytest.mark.parametrize(
    ("images", "content", "says"),
    [
        (["coco/a.jpg"], [IMAGE_SLOT, IMAGE_SLOT, {"type": "text", "text": "?"}], "more"),
        ([], [IMAGE_SLOT, {"type": "text", "text": "?"}], "more"),
        (None, [IMAGE_SLOT, {"type": "text", "text": "?"}], "more"),
        (["coco/a.jpg", "coco/b.jpg"], [IMAGE_SLOT, {"type": "text", "text": "?"}], "1 left"),
        (["coco/a.jpg"], [{"type": "text", "text": "no image part"}], "1 left unused"),
    ],
)
def test_trl_parts_and_images_that_do_not_pair_up_are_quarantined(images, content, says) -> None:
    record = _trl(images, content, "A cat.")
    with pytest.raises(Rejected, match=says) as info:
        normalize(record, "messages", PROBES)
    assert info.value.reason is DropReason.IMAGE_PLACEHOLDER_MISMATCH


def test_an_unusable_entry_of_the_images_column_is_a_malformed_row() -> None:
    record = _trl([{"bytes": None, "path": None}], [IMAGE_SLOT, {"type": "text", "text": "?"}], "x")
    assert image_references(record, "messages") == []
    with pytest.raises(Rejected, match="'images' entry 0") as info:
        normalize(record, "messages", PROBES)
    assert info.value.reason is DropReason.MALFORMED_ROW


def test_an_unavailable_column_image_quarantines_the_row() -> None:
    record = _trl(["coco/gone.jpg"], [IMAGE_SLOT, {"type": "text", "text": "?"}], "x")
    with pytest.raises(Rejected) as info:
        normalize(record, "messages", PROBES)
    assert info.value.reason is DropReason.IMAGE_UNAVAILABLE


# -- the prompts format -------------------------------------------------------------


def test_a_prompt_string_is_one_user_turn() -> None:
    conv = normalize({"prompt": "Write a haiku."}, "prompts", {}, benchmark=True)
    assert conv.turns == [{"role": "user", "content": "Write a haiku."}]


def test_a_list_of_prompts_is_asked_turn_after_turn() -> None:
    record = {"prompt": ["Write a haiku.", "Now in French."], "category": "writing"}
    conv = normalize(record, "prompts", {}, benchmark=True)
    assert conv.turns == [
        {"role": "user", "content": "Write a haiku."},
        {"role": "user", "content": "Now in French."},
    ]


def test_prompt_images_come_before_the_first_turns_text() -> None:
    columns = PromptColumns(prompt="question", image="image", answer="answer")
    record = {"question": "Which?", "image": ["coco/a.jpg", "coco/b.jpg"], "answer": "B"}
    assert image_references(record, "prompts", columns) == ["coco/a.jpg", "coco/b.jpg"]
    assert image_references(record, "prompts") == []  # the default columns name no image
    conv = normalize(record, "prompts", PROBES, columns)
    assert conv.turns == [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": "/data/coco/coco/a.jpg", "sha256": "h1"},
                {"type": "image", "path": "/data/coco/coco/b.jpg", "sha256": "h2"},
                {"type": "text", "text": "Which?"},
            ],
        },
        {"role": "assistant", "content": "B"},
    ]
    single = normalize({**record, "image": "coco/a.jpg"}, "prompts", PROBES, columns)
    assert len(single.images) == 1 and single.turns[0]["content"][0]["type"] == "image"


def test_prompt_answers_one_per_turn_become_assistant_turns() -> None:
    columns = PromptColumns(answer="reference")
    record = {"prompt": ["q1", "q2"], "reference": ["a1", "a2"]}
    conv = normalize(record, "prompts", {}, columns)
    assert [(t["role"], t["content"]) for t in conv.turns] == [
        ("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"),
    ]  # fmt: skip
    assert reply_indices(conv.turns) == [1, 3]
    no_reference = normalize({**record, "reference": []}, "prompts", {}, columns, benchmark=True)
    assert [t["role"] for t in no_reference.turns] == ["user", "user"]


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ({"question": "?"}, "no prompt in column 'prompt' \\(the record's columns: question"),
        ({"prompt": ""}, "'prompt' turn 0 is empty"),
        ({"prompt": "  "}, "'prompt' turn 0 is empty"),
        ({"prompt": []}, "'prompt' is an empty list of turns"),
        ({"prompt": ["q1", None]}, "'prompt' turn 1 is None, expected a string"),
        ({"prompt": ["q1", "q2"], "answer": "a"}, "one string for 2 prompt turns"),
        ({"prompt": ["q1", "q2"], "answer": ["a1"]}, "one answer per prompt turn \\(2\\)"),
        ({"prompt": "q", "image": 7}, "'image' entry 0 is 7"),
    ],
)
def test_a_prompt_row_without_a_usable_prompt_is_malformed(record, says) -> None:
    columns = PromptColumns(image="image", answer="answer")
    with pytest.raises(Rejected, match=says) as info:
        normalize(record, "prompts", {}, columns, benchmark=True)
    assert info.value.reason is DropReason.MALFORMED_ROW


# -- benchmark rows -----------------------------------------------------------------


def test_rows_without_a_reply_are_accepted_only_for_benchmarks() -> None:
    question = {"messages": [{"role": "user", "content": "Why is the sky blue?"}]}
    with pytest.raises(Rejected) as info:
        normalize(question, "messages", {})
    assert info.value.reason is DropReason.NO_ASSISTANT_TURN
    with pytest.raises(Rejected) as info:
        normalize({"prompt": "q"}, "prompts", {})
    assert info.value.reason is DropReason.NO_ASSISTANT_TURN
    assert normalize(question, "messages", {}, benchmark=True).turns == question["messages"]
    only_system = {"messages": [{"role": "system", "content": "Be brief."}]}
    with pytest.raises(Rejected) as info:
        normalize(only_system, "messages", {}, benchmark=True)
    assert info.value.reason is DropReason.NO_USER_TURN


def _bench(**fields) -> DatasetSpec:
    return DatasetSpec(name="b", path="/b", format="prompts", role="benchmark", **fields)


def test_a_benchmark_rows_category_comes_from_its_value_column_or_file() -> None:
    record = {"prompt": "q", "category": "math"}
    assert _bench(category="chat").category_of(record, "/b/qa.jsonl") == "chat"
    assert _bench(category_column="category").category_of(record, None) == "math"
    assert _bench(category_column="category").category_of({"prompt": "q"}, None) == "all"
    by_file = _bench(category_from_file=True)
    assert by_file.category_of(record, "/b/tool_call.jsonl") == "tool_call"
    assert by_file.category_of(record, "HumanEval.jsonl") == "HumanEval"
    assert by_file.category_of(record, "/b/v1.2_math.jsonl") == "v1.2_math"
    assert by_file.category_of(record, "/b/chat.jsonl.gz") == "chat"
    assert by_file.category_of(record, "/b/.hidden.jsonl") == ".hidden"
    assert by_file.category_of(record, None) == "all"  # a raw table without source files
    assert _bench().category_of(record, "/b/qa.jsonl") == "all"


@pytest.mark.parametrize("name", ["a#b.png", "pct%41.png", "%2e%2e/x.png", "sp ace?.png"])
def test_a_file_url_names_the_file_vllm_opens(name: str) -> None:
    """vLLM parses the URL (urllib3's `parse_url`, then `url2pathname` of netloc + path:
    vllm/multimodal/media/connector.py); the path it gets back is the probed one."""
    from urllib.request import url2pathname

    from urllib3.util import parse_url

    path = f"/data/coco/{name}"
    turns = [{"role": "user", "content": [{"type": "image", "path": path}]}]
    url = to_vllm_messages(turns)[0]["content"][0]["image_url"]["url"]
    parsed = parse_url(url)
    assert parsed.scheme == "file"
    assert url2pathname((parsed.netloc or "") + (parsed.path or "")) == path


def test_a_category_named_overall_does_not_collide_with_the_sum_row() -> None:
    from mm_assets.services.benchmarking import category_name

    assert category_name("overall") == "overall (category)"
    assert category_name(None) == category_name("") == "all"
    assert category_name("math") == "math"
