"""Loss masks, lazy image-token expansion and truncation, on the demo's real processors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from mm_assets.domain.ingest.images import probe_reference
from mm_assets.domain.prep.conversations import Rejected, image_references, normalize
from mm_assets.domain.prep.positions import placed_positions, uses_mrope
from mm_assets.domain.prep.supervision import (
    GENERATION_MARKER,
    TokenizeDropReason,
    TokenizeRejected,
    check_generated_ids,
    mask_from_spans,
    supervised_runs,
)
from mm_assets.domain.prep.tokenization import ChatTokenizer, expand_image_tokens, truncate
from tests.pixel_reference import tokenize_with_pixels
from tests.qwen3_vl_target import write_qwen3_vl_target

# -- pure functions ----------------------------------------------------------------


def test_mask_from_spans_marks_overlapping_tokens() -> None:
    offsets = [(0, 3), (3, 5), (5, 9), (9, 9), (9, 12)]
    assert mask_from_spans(offsets, [(4, 9)]) == [0, 1, 1, 0, 0]
    assert mask_from_spans(offsets, [(0, 3), (9, 12)]) == [1, 0, 0, 1, 1]


def test_expand_image_tokens_repeats_each_image_by_its_own_count() -> None:
    ids, mask = expand_image_tokens([1, 9, 2, 9, 3], [0, 0, 1, 0, 1], 9, [3, 2])
    assert ids == [1, 9, 9, 9, 2, 9, 9, 3]
    assert mask == [0, 0, 0, 0, 1, 0, 0, 1]


@pytest.mark.parametrize(("max_length", "cut"), [(3, 2), (4, 2), (5, 5), (2, 2), (6, 6)])
def test_truncate_never_splits_an_image_block(max_length: int, cut: int) -> None:
    ids = [1, 2, 9, 9, 9, 3, 4, 5]
    out, mask, truncated = truncate(ids, [1] * 8, max_length, image_token_id=9)
    assert out == ids[:cut] and len(mask) == cut and truncated


def test_truncate_leaves_short_rows_alone() -> None:
    assert truncate([1, 2], [0, 1], 5, 9) == ([1, 2], [0, 1], False)


# -- on the demo's processors ------------------------------------------------------


def _demo_conversations(demo_dir: Path, multimodal_only: bool = True):
    """Every usable demo conversation with its image sizes, via the domain functions."""
    records = json.loads((demo_dir / "data" / "sharegpt4v_coco.json").read_text())
    root = demo_dir / "coco"
    out = []
    for record in records:
        refs = image_references(record, "sharegpt4v")
        probes = {r: probe_reference(root, r, "coco/") for r in refs}
        try:
            conv = normalize(record, "sharegpt4v", probes)
        except Rejected:
            continue
        out.append((conv.turns, [(p.height, p.width) for p in conv.images]))
    assert len(out) > 150
    return out


def _without_generation_markers(processor):
    clone = copy.copy(processor)
    clone.chat_template = processor.chat_template.replace("{%- generation -%}", "").replace(
        "{%- endgeneration -%}", ""
    )
    assert not GENERATION_MARKER.search(clone.chat_template)
    return clone


def test_lazy_ids_equal_the_processor_on_pixels_for_every_demo_sample(
    demo_dir: Path, demo_processor
) -> None:
    lazy = ChatTokenizer(demo_processor, max_length=100_000)
    assert lazy.multimodal and lazy.mask_method == "generation_markers"
    for turns, sizes in _demo_conversations(demo_dir):
        (row,) = lazy.tokenize(turns, sizes)
        eager = tokenize_with_pixels(demo_processor, turns)
        assert row.input_ids == eager["input_ids"]
        assert row.loss_mask == eager["loss_mask"]
        assert row.input_ids.count(lazy.image_token_id) > len(sizes)  # really expanded


def test_lazy_ids_equal_pixels_for_a_llava_style_processor(demo_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoProcessor

    from mm_assets.demo.data import demo_corpus
    from mm_assets.demo.target import build_llava_style_target

    processor = AutoProcessor.from_pretrained(
        build_llava_style_target(tmp_path / "llava", demo_corpus(demo_dir))
    )
    lazy = ChatTokenizer(processor, max_length=100_000)
    assert lazy.mask_method == "prefix_render"
    per_image = set()
    for turns, sizes in _demo_conversations(demo_dir)[:60]:
        (row,) = lazy.tokenize(turns, sizes)
        assert row.input_ids == tokenize_with_pixels(processor, turns)["input_ids"]
        per_image.add(row.input_ids.count(lazy.image_token_id) // len(sizes))
    assert len(per_image) == 1 and per_image.pop() > 1  # a fixed count per image


def test_prefix_render_mask_equals_the_generation_marker_mask(
    demo_dir: Path, demo_processor
) -> None:
    with_markers = ChatTokenizer(demo_processor, max_length=100_000)
    fallback = ChatTokenizer(_without_generation_markers(demo_processor), max_length=100_000)
    assert fallback.mask_method == "prefix_render"
    checked = 0
    for turns, sizes in _demo_conversations(demo_dir)[:80]:
        (a,) = with_markers.tokenize(turns, sizes)
        (b,) = fallback.tokenize(turns, sizes)
        assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask
        checked += sum(t["role"] == "assistant" for t in turns) > 1
    assert checked > 5  # multi-turn conversations were among them


def test_supervised_tokens_are_exactly_the_assistant_replies(demo_processor) -> None:
    chat = ChatTokenizer(demo_processor, max_length=4096)
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Blue."},
    ]
    (row,) = chat.tokenize(turns)
    supervised = [t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m]
    assert chat.tokenizer.decode(supervised) == "Red.<|im_end|>Blue.<|im_end|>"


def test_supervised_runs_are_the_consecutive_spans() -> None:
    assert supervised_runs([0, 1, 1, 0, 0, 1, 0, 1]) == [(1, 3), (5, 6), (7, 8)]
    assert supervised_runs([0, 0]) == []


def test_generated_ids_are_what_the_row_supervises(demo_processor) -> None:
    """The target's ids (ending with its stop token) are exactly the supervised tokens
    when the template re-tokenizes the decoded text the same way; a sequence the
    tokenizer would never produce for that text (a split word) is refused."""
    chat = ChatTokenizer(demo_processor, max_length=4096)
    tok = chat.tokenizer
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red is warm."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Blue."},
    ]
    (row,) = chat.tokenize(turns)
    stop, special = tok.convert_tokens_to_ids("<|im_end|>"), set(tok.all_special_ids)
    replies = [(1, [*tok.encode("Red is warm."), stop]), (3, [*tok.encode("Blue."), stop])]
    assert check_generated_ids(row, replies, special) == 2
    canonical = tok.encode("Red is warm.")
    split = [i for piece in tok.convert_ids_to_tokens(canonical) for i in
             tok.convert_tokens_to_ids(list(piece))]  # fmt: skip
    assert tok.decode(split) == "Red is warm." and split != canonical
    with pytest.raises(TokenizeRejected) as info:
        check_generated_ids(row, [(1, [*split, stop]), replies[1]], special)
    assert info.value.reason == TokenizeDropReason.RETOKENIZATION_MISMATCH
    assert "reply 0: token" in info.value.detail

    # rebuilt reply by reply: each row is the prompt the target was asked (earlier
    # replies as text, as vLLM tokenized them), the generated ids, the closing token
    odd = [(1, [*split, stop]), replies[1]]
    first, second = chat.reply_rows(turns, odd, special)
    assert (first.num_turns, second.num_turns) == (2, 4)
    for rebuilt, (index, ids) in zip((first, second), odd, strict=True):
        assert check_generated_ids(rebuilt, odd, special) == 1
        supervised = [t for t, m in zip(rebuilt.input_ids, rebuilt.loss_mask, strict=True) if m]
        assert supervised == ids  # the generated ids, then the template's <|im_end|>
        asked = tok(chat.render(turns[:index], add_generation_prompt=True))["input_ids"]
        assert rebuilt.input_ids[: len(asked)] == asked and len(asked) + len(ids) == len(
            rebuilt.input_ids
        )
    # the second reply's context holds the first as text, not the odd ids
    assert first.input_ids[:-1] != second.input_ids[: len(first.input_ids) - 1]


def test_history_rewriting_template_gives_one_row_per_assistant_turn(demo_processor) -> None:
    """A template that hides earlier answers (as reasoning templates drop old <think>)."""
    clone = copy.copy(demo_processor)
    clone.chat_template = (
        "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' and not loop.last -%}(earlier answer)"
        "{%- else -%}{{ m.content }}{%- endif -%}<|im_end|>\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
    )
    chat = ChatTokenizer(clone, max_length=4096)
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Blue."},
    ]
    rows = chat.tokenize(turns)
    assert [r.num_turns for r in rows] == [2, 4]
    decoded = [
        chat.tokenizer.decode([t for t, m in zip(r.input_ids, r.loss_mask, strict=True) if m])
        for r in rows
    ]
    assert decoded == ["Red.<|im_end|>", "Blue.<|im_end|>"]


def test_truncation_with_a_real_processor_stops_before_the_image_block(
    demo_dir: Path, demo_processor
) -> None:
    turns, sizes = next((t, s) for t, s in _demo_conversations(demo_dir) if s and min(s[0]) >= 100)
    full = ChatTokenizer(demo_processor, max_length=100_000).tokenize(turns, sizes)[0]
    image_id = demo_processor.image_token_id
    first = full.input_ids.index(image_id)
    # A limit inside the image block, with the assistant reply beyond it: nothing left to
    # supervise, so the row is refused with its reason rather than cut mid-image.
    short = ChatTokenizer(demo_processor, max_length=first + 3)
    with pytest.raises(TokenizeRejected) as info:
        short.tokenize(turns, sizes)
    assert info.value.reason is TokenizeDropReason.NO_SUPERVISED_TOKENS
    # A limit past the image keeps the whole block and cuts later.
    limit = len(full.input_ids) - 2
    (row,) = ChatTokenizer(demo_processor, max_length=limit).tokenize(turns, sizes)
    assert row.truncated and len(row.input_ids) == limit
    assert row.input_ids.count(image_id) == full.input_ids.count(image_id)


def test_template_that_drops_images_is_refused(demo_processor) -> None:
    clone = copy.copy(demo_processor)
    clone.chat_template = (
        "{%- for m in messages -%}{{ m.role }}: "
        "{%- if m.content is string -%}{{ m.content }}{%- endif -%}\n{%- endfor -%}"
    )
    turns = [
        {
            "role": "user",
            "content": [{"type": "image", "path": "/x.jpg"}, {"type": "text", "text": "?"}],
        },
        {"role": "assistant", "content": "ok"},
    ]
    with pytest.raises(TokenizeRejected) as info:
        ChatTokenizer(clone, max_length=4096).tokenize(turns, [(56, 56)])
    assert info.value.reason is TokenizeDropReason.TEMPLATE_ERROR


def test_a_plain_tokenizer_target_is_text_only(demo_processor) -> None:
    tokenizer = copy.copy(demo_processor.tokenizer)
    tokenizer.chat_template = demo_processor.chat_template
    chat = ChatTokenizer(tokenizer, max_length=4096)
    assert not chat.multimodal and chat.image_token_id is None
    (row,) = chat.tokenize(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]
    )
    assert row.num_supervised > 0 and row.num_images == 0


def test_rows_supervising_only_special_tokens_are_refused(demo_processor) -> None:
    """An answer cut by max_length right after it starts supervises only the template's
    end-of-turn marker (or nothing): no row worth training on."""
    chat = ChatTokenizer(demo_processor, max_length=4096)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there."}]
    (row,) = chat.tokenize(turns)
    reply = chat.content_tokens(row)
    special = [
        t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m and t in chat.special_ids
    ]
    assert reply > 0 and special, "the demo template ends a turn with a special token"
    assert reply + len(special) == row.num_supervised
    assert ChatTokenizer(demo_processor, max_length=4096, min_supervised_tokens=reply).tokenize(
        turns
    )
    with pytest.raises(TokenizeRejected, match=f"{reply} supervised") as info:
        ChatTokenizer(demo_processor, max_length=4096, min_supervised_tokens=reply + 1).tokenize(
            turns
        )
    assert info.value.reason is TokenizeDropReason.TOO_FEW_SUPERVISED_TOKENS
    # only the end-of-turn marker: the row the issue found in the adversarial corpus
    ids = row.input_ids
    mask = [
        1 if (m and t in chat.special_ids) else 0 for t, m in zip(ids, row.loss_mask, strict=True)
    ]
    marker_row = type(row)(ids, mask, row.num_turns, 0, False)
    with pytest.raises(TokenizeRejected) as info:
        chat.worth_training([marker_row])
    assert info.value.reason is TokenizeDropReason.TOO_FEW_SUPERVISED_TOKENS


def test_an_unexpected_error_in_a_template_is_not_a_rejection(demo_processor) -> None:
    """A template error raised on purpose (`raise_exception`) rejects the row; a Python
    error inside the template is a setup problem the caller sees as it is."""
    refusing = copy.copy(demo_processor)
    refusing.chat_template = "{{ raise_exception('no system turns') }}"
    broken = copy.copy(demo_processor)
    broken.chat_template = "{{ messages[0].content + 1 }}"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(TokenizeRejected) as info:
        ChatTokenizer(refusing, max_length=4096).tokenize(turns)
    assert info.value.reason is TokenizeDropReason.TEMPLATE_ERROR
    assert info.value.kind == "template_error (TemplateError)"
    with pytest.raises(TypeError):
        ChatTokenizer(broken, max_length=4096).tokenize(turns)


# -- the stage: bad rows quarantined, a broken setup stops it ------------------------


def _conversations(tables, n: int, empty_replies: int = 0) -> None:
    from mm_assets.storage import schemas

    def turns(i: int) -> str:
        reply = "" if i < empty_replies else f"Answer number {i}."
        return json.dumps(
            [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": reply}]
        )

    rows = [
        {
            "sample_id": f"s{i}", "source_index": i, "turns": turns(i), "multimodal": False,
            "image_paths": [], "image_hashes": [], "image_heights": [], "image_widths": [],
            "responses": "dataset", "response_key": None, "reply_turns": [],
            "reply_token_ids": [], "finish_reasons": [],
        }
        for i in range(n)
    ]  # fmt: skip
    tables.write("target_responses", "p", rows, schemas.TARGET_RESPONSES)


def test_the_stage_quarantines_rare_bad_rows_and_stops_on_a_broken_setup(
    demo_processor, tmp_path: Path
) -> None:
    from mm_assets.domain.rejection import RowFailureWatch, SetupProblem
    from mm_assets.services.prep import tokenize_partition
    from mm_assets.storage import TableStore

    tables = TableStore(tmp_path)
    _conversations(tables, 20, empty_replies=3)  # (normalization drops these; here: late)
    report = tokenize_partition("p", tables, ChatTokenizer(demo_processor, max_length=4096))
    assert (report.kept.num_rows, report.quarantine.num_rows) == (17, 3)
    assert report.conversations == 20
    assert dict(report.reasons) == {"too_few_supervised_tokens": 3}

    _conversations(tables, 20, empty_replies=11)
    with pytest.raises(SetupProblem, match=r"11 of the first 20 rows .*too_few_supervised"):
        tokenize_partition("p", tables, ChatTokenizer(demo_processor, max_length=4096))
    # a dataset that really is like that: the share is raised, and the rows quarantined
    report = tokenize_partition(
        "p",
        tables,
        ChatTokenizer(demo_processor, max_length=4096),
        RowFailureWatch(first_rows=100, max_share=0.9),
    )
    assert report.quarantine.num_rows == 11

    broken = copy.copy(demo_processor)
    broken.chat_template = "{{ messages[0].content + 1 }}"
    with pytest.raises(RuntimeError, match=r"tokenizing sample s0 \(source row 0\) failed with"):
        tokenize_partition("p", tables, ChatTokenizer(broken, max_length=4096))
    # the failed runs left the last good table in place
    assert tables.num_rows("tokenized_samples", "p") == 9


# -- positions ------------------------------------------------------------------------


def test_placed_positions_hold_an_image_still_and_move_past_it() -> None:
    ids = [1, 9, 9, 9, 9, 9, 9, 2, 9, 9, 3]
    assert placed_positions(ids, 9, [6, 2], [3, 1]) == [0, 1, 1, 1, 1, 1, 1, 4, 5, 5, 6]
    with pytest.raises(ValueError, match="fewer than its 6 tokens"):
        placed_positions([1, 9, 9, 2], 9, [6], [3])


@pytest.fixture(scope="module")
def qwen3_vl_dir(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_vl_target(demo_dir / "target", tmp_path_factory.mktemp("qwen3_vl"))


@pytest.mark.parametrize("architecture", ["qwen2_5_vl", "qwen3_vl"])
def test_image_rows_carry_the_temporal_row_of_the_targets_rope_index(
    demo_dir: Path, qwen3_vl_dir: Path, architecture: str
) -> None:
    """The positions stored with each image row are row 0 of what transformers' own
    model of the architecture computes from the decoded images (vLLM serves the draft
    that row), for the demo's Qwen2.5-VL target and a Qwen3-VL one; text rows, and a
    target without M-RoPE, store none (0..n-1)."""
    import torch
    from transformers import AutoConfig, AutoProcessor
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    target = {"qwen2_5_vl": demo_dir / "target", "qwen3_vl": qwen3_vl_dir}[architecture]
    model_class = {"qwen2_5_vl": Qwen2_5_VLModel, "qwen3_vl": Qwen3VLModel}[architecture]
    processor = AutoProcessor.from_pretrained(target)
    config = AutoConfig.from_pretrained(target)
    assert uses_mrope(config.to_dict()) and not uses_mrope({"rope_parameters": {"rope_theta": 1}})
    rope_index = model_class(config).get_rope_index
    chat = ChatTokenizer(processor, max_length=100_000, mrope=True)
    conversations = _demo_conversations(demo_dir)[:12]
    two = [t for t, _ in conversations[:2]]
    both = [two[0][0], *two[1], *two[0][1:]]  # two images, of two sizes, in one row
    sizes = [conversations[0][1][0], conversations[1][1][0]]
    assert sizes[0] != sizes[1]
    for turns, image_sizes in [*conversations, (both, sizes)]:
        (row,) = chat.tokenize(turns, image_sizes)
        eager = tokenize_with_pixels(processor, turns)
        assert row.input_ids == eager["input_ids"]
        ids = torch.tensor([eager["input_ids"]])
        kinds = (ids == chat.image_token_id).int()
        grids = torch.tensor(eager["image_grid_thw"])
        expected = rope_index(ids, kinds, image_grid_thw=grids)[0][0, 0].tolist()
        assert row.position_ids == expected
        assert row.position_ids != list(range(len(row.input_ids)))
    text = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    assert chat.tokenize(text)[0].position_ids is None
    (turns, image_sizes), *_ = conversations
    plain = ChatTokenizer(processor, max_length=100_000)
    assert plain.tokenize(turns, image_sizes)[0].position_ids is None
