"""Chat-template tokenization with loss masks, lazy about images.

An image's placeholder tokens are counted from its header size through the processor's
own `_get_num_multimodal_tokens` (the method vLLM relies on), so no pixel is decoded here.

Loss masks are template-agnostic: HF's assistant-token mask when the template marks
replies with `{% generation %}`; otherwise, for reply j, what the render of `turns[:j+1]`
adds to the render of `turns[:j]` with the generation prompt (trailing whitespace
excluded: template formatting, never generated). A template that rewrites history (as
reasoning templates dropping old `<think>` blocks do) gets one row per reply, so no row
trains on a history inference never sees. Only replies (`reply_indices`) are supervised.

Special-token strings in dataset text (`<|im_end|>` typed into a prompt) are tokenized as
control tokens in a prompt, as vLLM encodes a rendered chat (`vllm/renderers/base.py`,
`_tokenize_prompt`), so the stored ids are those the deployed target reads. In a reply
the row is quarantined (`special_token_in_reply`): the target never writes one there,
and the text would tokenize differently again once it is history in a later prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from mm_assets.domain.prep.conversations import (
    Turn,
    map_parts,
    opens_with_assistant,
    reply_indices,
    turn_text,
)
from mm_assets.domain.prep.positions import image_advance, placed_positions
from mm_assets.domain.prep.supervision import (
    GENERATION_MARKER,
    TokenizeDropReason,
    TokenizedRow,
    TokenizeRejected,
    control_token_ids,
    mask_from_spans,
    without_trailing,
)

if TYPE_CHECKING:  # transformers is imported where it is used: it takes seconds
    from transformers import PreTrainedTokenizerBase


def count_images(turns: Sequence[Turn]) -> int:
    return sum(
        1
        for t in turns
        if isinstance(t["content"], list)
        for p in t["content"]
        if p["type"] == "image"
    )


def expand_image_tokens(
    ids: Sequence[int], mask: Sequence[int], image_token_id: int, counts: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Replace the i-th image token with `counts[i]` copies (never supervised)."""
    out_ids: list[int] = []
    out_mask: list[int] = []
    images = iter(counts)
    for token, supervised in zip(ids, mask, strict=True):
        image = token == image_token_id
        n = next(images) if image else 1
        out_ids += [token] * n
        out_mask += [0 if image else supervised] * n
    return out_ids, out_mask


def collapse_image_tokens(ids: Sequence[int], image_token_id: int) -> list[int]:
    """Each run of image placeholder tokens as one token: the prompt form vLLM expands
    again from the image itself (the inverse of `expand_image_tokens`)."""
    return [
        token
        for i, token in enumerate(ids)
        if not (token == image_token_id and i and ids[i - 1] == image_token_id)
    ]


def truncate(
    ids: list[int], mask: list[int], max_length: int, image_token_id: int | None
) -> tuple[list[int], list[int], bool]:
    """Cut at `max_length`, moved back to the start of an image-token block it would split."""
    if len(ids) <= max_length:
        return ids, mask, False
    cut = max_length
    if image_token_id is not None:
        while cut > 0 and ids[cut] == image_token_id and ids[cut - 1] == image_token_id:
            cut -= 1
    return ids[:cut], mask[:cut], True


class ChatTokenizer:
    """Tokenizes normalized conversations for a target's processor or tokenizer."""

    def __init__(
        self,
        processor: Any,
        max_length: int,
        min_supervised_tokens: int = 1,
        *,
        mrope: bool = False,
    ) -> None:
        """`mrope`: the target rotates by M-RoPE positions (`positions.uses_mrope`), so
        image rows carry the positions vLLM serves the draft with."""
        from transformers import ProcessorMixin

        self.multimodal = isinstance(processor, ProcessorMixin)
        self.processor = processor
        self.tokenizer: PreTrainedTokenizerBase = (
            processor.tokenizer if self.multimodal else processor
        )
        self.max_length = max_length
        self.min_supervised_tokens = min_supervised_tokens
        self.special_ids = control_token_ids(self.tokenizer)
        template = getattr(processor, "chat_template", None) or self.tokenizer.chat_template
        if not template:
            raise ValueError(
                "the target's processor/tokenizer has no chat template; add one "
                "(chat_template.jinja beside the model) so conversations can be rendered"
            )
        self.chat_template: str = template
        self.uses_generation_markers = bool(GENERATION_MARKER.search(template))
        self.image_token_id: int | None = None
        self.mrope = mrope
        self._advances: dict[tuple[int, int], int] = {}
        if self.multimodal:
            self.image_token_id = getattr(processor, "image_token_id", None)
            if self.image_token_id is None and getattr(processor, "image_token", None):
                self.image_token_id = self.tokenizer.convert_tokens_to_ids(processor.image_token)
            if not hasattr(processor, "_get_num_multimodal_tokens"):
                raise ValueError(
                    f"{type(processor).__name__} cannot report image token counts from image "
                    "sizes (_get_num_multimodal_tokens); lazy tokenization needs it"
                )
            if mrope and not hasattr(getattr(processor, "image_processor", None), "merge_size"):
                raise ValueError(
                    f"{type(processor).__name__}: the target uses M-RoPE but its image "
                    "processor names no merge_size, so the positions vLLM gives the draft "
                    "cannot be laid out; use the processor the target ships with"
                )

    @property
    def mask_method(self) -> str:
        return "generation_markers" if self.uses_generation_markers else "prefix_render"

    def image_token_counts(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        """Placeholder tokens per image from its (height, width), without pixels."""
        if not sizes:
            return []
        data = self.processor._get_num_multimodal_tokens(image_sizes=[list(s) for s in sizes])
        return [int(n) for n in data.num_image_tokens]

    def image_advances(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        """Positions each image takes in an M-RoPE target's temporal row, from the grid
        its image processor lays over a blank image of its (height, width): no pixel of
        the image is read, and each size is laid out once."""
        from PIL import Image

        image_processor = self.processor.image_processor
        for size in dict.fromkeys(s for s in map(tuple, sizes) if s not in self._advances):
            blank = Image.new("RGB", (size[1], size[0]))
            grid = image_processor(images=[blank], return_tensors="np")["image_grid_thw"][0]
            self._advances[size] = image_advance(grid, image_processor.merge_size)
        return [self._advances[tuple(s)] for s in sizes]

    def _apply_template(self, turns: Sequence[Turn], **options: Any) -> Any:
        return self.tokenizer.apply_chat_template(
            # as chat templates expect them: image parts carry no path or pixels
            map_parts(turns, lambda p: {"type": "image"} if p["type"] == "image" else p),
            chat_template=self.chat_template,
            **options,
        )

    def render(self, turns: Sequence[Turn], add_generation_prompt: bool = False) -> str:
        return self._apply_template(
            turns, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str, spans: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Ids of rendered text as vLLM encodes a rendered chat (no added BOS; special-token
        strings read as special tokens), 1 where a token overlaps a span."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), mask_from_spans(enc["offset_mapping"], spans)

    def _rows_from_markers(self, turns: Sequence[Turn]) -> list[tuple[int, list, list]]:
        out = self._apply_template(
            turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        replies = reply_indices(turns)
        if not replies:
            mask = [0] * len(ids)
        elif opens_with_assistant(turns):
            mask = self._context_unsupervised(turns, replies[0], ids, mask)
        return [(len(turns), ids, mask)]

    def _context_unsupervised(
        self, turns: Sequence[Turn], first_reply: int, ids: list[int], mask: list[int]
    ) -> list[int]:
        """`mask` with nothing supervised before the first reply's generation prompt ends:
        the template marks the opening assistant turns as generation too, but they answer
        no question in the row."""
        prompt = self.render(turns[:first_reply], add_generation_prompt=True)
        full = self.render(turns)
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        if not full.startswith(prompt) or list(enc["input_ids"]) != ids:
            raise TokenizeRejected(
                TokenizeDropReason.TEMPLATE_ERROR,
                f"turn {first_reply}: the conversation opens with an assistant turn and the "
                "full render does not extend the first reply's prompt, so that turn cannot "
                "be told apart from the replies",
            )
        starts = [start for start, _ in enc["offset_mapping"]]
        return [m if start >= len(prompt) else 0 for m, start in zip(mask, starts, strict=True)]

    def _rows_from_prefix_renders(self, turns: Sequence[Turn]) -> list[tuple[int, list, list]]:
        full = self.render(turns)
        spans: list[tuple[int, int]] = []
        renders: list[str] = []
        extends_history = True
        replies = reply_indices(turns)
        for j in replies:
            prompt = self.render(turns[:j], add_generation_prompt=True)
            upto = self.render(turns[: j + 1])
            if not upto.startswith(prompt):
                raise TokenizeRejected(
                    TokenizeDropReason.TEMPLATE_ERROR,
                    f"turn {j}: the render with the assistant turn does not extend the "
                    "render with the generation prompt; the template cannot be masked",
                )
            end = max(len(prompt), len(upto.rstrip()))
            spans.append((len(prompt), end))
            renders.append(upto)
            extends_history &= full.startswith(upto)
        if extends_history:
            return [(len(turns), *self._encode(full, spans))]
        return [
            (j + 1, *self._encode(text, [span]))
            for j, text, span in zip(replies, renders, spans, strict=True)
        ]

    def _refuse_special_tokens_in_replies(self, turns: Sequence[Turn]) -> None:
        for j in reply_indices(turns):
            ids = self.tokenizer(turn_text(turns[j]), add_special_tokens=False)["input_ids"]
            found = sorted({t for t in ids if t in self.special_ids})
            if found:
                raise TokenizeRejected(
                    TokenizeDropReason.SPECIAL_TOKEN_IN_REPLY,
                    f"turn {j} holds {self.tokenizer.convert_ids_to_tokens(found)}, text the "
                    "tokenizer reads as special tokens; the target never writes one inside "
                    "a reply (clean the reply, or drop the row from the dataset)",
                )

    def tokenize(
        self, turns: Sequence[Turn], image_sizes: Sequence[tuple[int, int]] = ()
    ) -> list[TokenizedRow]:
        """Rows for one conversation; `image_sizes` are (height, width) in part order."""
        try:
            if self.uses_generation_markers:
                raw_rows = self._rows_from_markers(turns)
            else:
                raw_rows = self._rows_from_prefix_renders(turns)
        except TemplateError as exc:  # the template refusing this row's content
            opening = opens_with_assistant(turns)
            note = " (the conversation opens with an assistant turn)" if opening else ""
            raise TokenizeRejected(
                TokenizeDropReason.TEMPLATE_ERROR, f"{type(exc).__name__}: {exc}{note}"
            ) from exc
        rows = [
            self._training_row(turns, num_turns, ids, mask, image_sizes)
            for num_turns, ids, mask in raw_rows
        ]
        kept = self.worth_training(rows)
        self._refuse_special_tokens_in_replies(turns)
        return kept

    def content_tokens(self, row: TokenizedRow) -> int:
        """Supervised tokens that are not the tokenizer's special tokens: what the reply
        itself says, without the end-of-turn marker the template writes after it."""
        return sum(
            1
            for t, m in zip(row.input_ids, row.loss_mask, strict=True)
            if m and t not in self.special_ids
        )

    def worth_training(self, rows: list[TokenizedRow]) -> list[TokenizedRow]:
        """The rows with at least `min_supervised_tokens` content tokens, or
        `TokenizeRejected`: a row that supervises only template tokens (an empty reply, or
        one cut by `max_length` before its text) teaches the draft to end answers."""
        kept = [row for row in rows if self.content_tokens(row) >= self.min_supervised_tokens]
        if kept:
            return kept
        if not any(row.num_supervised for row in rows):
            raise TokenizeRejected(
                TokenizeDropReason.NO_SUPERVISED_TOKENS,
                f"no assistant token within max_length={self.max_length}",
            )
        most = max(self.content_tokens(row) for row in rows)
        raise TokenizeRejected(
            TokenizeDropReason.TOO_FEW_SUPERVISED_TOKENS,
            f"{most} supervised token(s) besides special tokens, fewer than "
            f"min_supervised_tokens={self.min_supervised_tokens}",
        )

    def _training_row(
        self,
        turns: Sequence[Turn],
        num_turns: int,
        ids: list[int],
        mask: list[int],
        image_sizes: Sequence[tuple[int, int]],
    ) -> TokenizedRow:
        """Rendered ids of `turns[:num_turns]` as a training row: each image token
        expanded to the processor's count for its size, then cut at `max_length`."""
        num_images = count_images(turns[:num_turns])
        positions = None
        if self.image_token_id is not None and num_images:
            rendered = ids.count(self.image_token_id)
            if rendered != num_images:
                raise TokenizeRejected(
                    TokenizeDropReason.TEMPLATE_ERROR,
                    f"the template rendered {rendered} image token(s) for {num_images} images",
                )
            counts = self.image_token_counts(image_sizes[:num_images])
            ids, mask = expand_image_tokens(ids, mask, self.image_token_id, counts)
            if self.mrope:
                advances = self.image_advances(image_sizes[:num_images])
                positions = placed_positions(ids, self.image_token_id, counts, advances)
        ids, mask, truncated = truncate(ids, mask, self.max_length, self.image_token_id)
        if positions is not None:
            positions = positions[: len(ids)]
        return TokenizedRow(ids, mask, num_turns, num_images, truncated, positions)

    def reply_rows(
        self,
        turns: Sequence[Turn],
        replies: Sequence[tuple[int, Sequence[int]]],
        special_ids: set[int],
        image_sizes: Sequence[tuple[int, int]] = (),
    ) -> list[TokenizedRow]:
        """One row per regenerated reply, made of exactly what the target read and wrote:
        the prompt rendered with the generation prompt, the ids it generated, and the
        tokens the template closes the turn with. For conversations whose full render
        re-tokenizes a reply differently, where one row would put ids the target never
        read before later replies."""
        rows = []
        for index, generated in replies:
            reply = without_trailing(generated, special_ids)
            prompt = self.render(turns[:index], add_generation_prompt=True)
            upto = self.render(turns[: index + 1])
            text = turns[index]["content"]
            if not isinstance(text, str) or not upto.startswith(prompt + text):
                raise TokenizeRejected(
                    TokenizeDropReason.RETOKENIZATION_MISMATCH,
                    f"turn {index}: the template does not write the reply verbatim after "
                    "the generation prompt; the reply's context cannot be rebuilt",
                )
            closing = upto[len(prompt) + len(text) :].rstrip()
            ids = [*self._encode(prompt, [])[0], *reply]
            mask = [0] * (len(ids) - len(reply)) + [1] * len(reply)
            closing_ids = self._encode(closing, [])[0] if closing else []
            ids, mask = ids + closing_ids, mask + [1] * len(closing_ids)
            rows.append(self._training_row(turns, index + 1, ids, mask, image_sizes))
        return self.worth_training(rows)
