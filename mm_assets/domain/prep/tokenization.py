"""Chat-template tokenization with loss masks, lazy about images.

Lazy multimodal: an image's placeholder tokens are counted from its header size through
the processor's own `_get_num_multimodal_tokens` (the method vLLM itself relies on), so no
pixel is decoded here; vLLM decodes images at hidden-state time and its prompt token ids
are compared with ours for every sample.

Loss masks are template-agnostic:
- when the chat template marks assistant content with `{% generation %}`, HF's
  assistant-token mask (`return_assistant_tokens_mask`);
- otherwise the prefix-render boundary: for assistant turn j, what the full render of
  `turns[:j+1]` adds to the render of `turns[:j]` with the generation prompt is
  supervised (trailing whitespace excluded: it is template formatting, never generated).
  If a template rewrites history (a later render is not an extension of an earlier one,
  as reasoning templates that drop old `<think>` blocks do), one row per assistant turn
  is emitted, so no row trains on a history inference never sees.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from mm_assets.domain.prep.conversations import Turn
from mm_assets.domain.rejection import RowRejected

if TYPE_CHECKING:  # transformers is imported where it is used: it takes seconds
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TokenizeDropReason(StrEnum):
    NO_SUPERVISED_TOKENS = "no_supervised_tokens"
    TOO_FEW_SUPERVISED_TOKENS = "too_few_supervised_tokens"
    TEMPLATE_ERROR = "template_error"
    RETOKENIZATION_MISMATCH = "retokenization_mismatch"


class TokenizeRejected(RowRejected):
    """A row this stage cannot use, with its reason."""


@dataclass(frozen=True)
class TokenizedRow:
    """One training row: ids, 0/1 loss mask, and how much of the conversation it covers."""

    input_ids: list[int]
    loss_mask: list[int]
    num_turns: int  # the row covers turns[:num_turns]
    num_images: int  # images inside those turns
    truncated: bool
    untruncated_length: int

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


def _template_turns(turns: Sequence[Turn]) -> list[Turn]:
    """Turns as chat templates expect them: image parts carry no path or pixels."""
    return [
        {**t, "content": [{"type": "image"} if p["type"] == "image" else p for p in t["content"]]}
        if isinstance(t["content"], list)
        else dict(t)
        for t in turns
    ]


def count_images(turns: Sequence[Turn]) -> int:
    return sum(
        1
        for t in turns
        if isinstance(t["content"], list)
        for p in t["content"]
        if p["type"] == "image"
    )


def mask_from_spans(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """1 for each token whose character range overlaps a supervised span."""
    mask = []
    for start, end in offsets:
        hit = any(
            (start < s_end and end > s_start) if end > start else s_start <= start < s_end
            for s_start, s_end in spans
        )
        mask.append(int(hit))
    return mask


def expand_image_tokens(
    ids: Sequence[int], mask: Sequence[int], image_token_id: int, counts: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Replace the i-th image token with `counts[i]` copies (never supervised)."""
    out_ids: list[int] = []
    out_mask: list[int] = []
    images = iter(counts)
    for token, supervised in zip(ids, mask, strict=True):
        if token == image_token_id:
            n = next(images)
            out_ids.extend([token] * n)
            out_mask.extend([0] * n)
        else:
            out_ids.append(token)
            out_mask.append(supervised)
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
        self, processor: Any, max_length: int = 4096, min_supervised_tokens: int = 1
    ) -> None:
        from transformers import ProcessorMixin

        self.multimodal = isinstance(processor, ProcessorMixin)
        self.processor = processor
        self.tokenizer: PreTrainedTokenizerBase = (
            processor.tokenizer if self.multimodal else processor
        )
        self.max_length = max_length
        self.min_supervised_tokens = min_supervised_tokens
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        template = getattr(processor, "chat_template", None) or self.tokenizer.chat_template
        if not template:
            raise ValueError(
                "the target's processor/tokenizer has no chat template; add one "
                "(chat_template.jinja beside the model) so conversations can be rendered"
            )
        self.chat_template: str = template
        self.uses_generation_markers = bool(GENERATION_MARKER.search(template))
        self.image_token_id: int | None = None
        if self.multimodal:
            self.image_token_id = getattr(processor, "image_token_id", None)
            if self.image_token_id is None and getattr(processor, "image_token", None):
                self.image_token_id = self.tokenizer.convert_tokens_to_ids(processor.image_token)
            if not hasattr(processor, "_get_num_multimodal_tokens"):
                raise ValueError(
                    f"{type(processor).__name__} cannot report image token counts from image "
                    "sizes (_get_num_multimodal_tokens); lazy tokenization needs it"
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

    def render(self, turns: Sequence[Turn], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            _template_turns(turns),
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def _encode(self, text: str, spans: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), mask_from_spans(enc["offset_mapping"], spans)

    def _rows_from_markers(self, turns: Sequence[Turn]) -> list[tuple[int, list, list]]:
        out = self.tokenizer.apply_chat_template(
            _template_turns(turns),
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        return [(len(turns), list(out["input_ids"]), list(out["assistant_masks"]))]

    def _rows_from_prefix_renders(self, turns: Sequence[Turn]) -> list[tuple[int, list, list]]:
        full = self.render(turns)
        spans: list[tuple[int, int]] = []
        renders: list[str] = []
        extends_history = True
        for j, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            prompt = self.render(turns[:j], add_generation_prompt=True) if j else ""
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
        assistant_turns = [j for j, t in enumerate(turns) if t["role"] == "assistant"]
        return [
            (j + 1, *self._encode(text, [span]))
            for j, text, span in zip(assistant_turns, renders, spans, strict=True)
        ]

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
            raise TokenizeRejected(
                TokenizeDropReason.TEMPLATE_ERROR, f"{type(exc).__name__}: {exc}"
            ) from exc
        rows = [
            self._training_row(turns, num_turns, ids, mask, image_sizes)
            for num_turns, ids, mask in raw_rows
        ]
        return self.worth_training(rows)

    def content_tokens(self, row: TokenizedRow) -> int:
        """Supervised tokens that are not the tokenizer's special tokens: what the reply
        itself says, without the end-of-turn marker the template writes after it."""
        return sum(
            1
            for t, m in zip(row.input_ids, row.loss_mask, strict=True)
            if m and t not in self.special_ids
        )

    def worth_training(self, rows: list[TokenizedRow]) -> list[TokenizedRow]:
        """The rows with at least `min_supervised_tokens` content tokens; `TokenizeRejected`
        when none is left. A row that supervises only template tokens (an empty reply,
        or one cut by `max_length` before its text) teaches the draft to end answers."""
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
        if self.image_token_id is not None and num_images:
            rendered = ids.count(self.image_token_id)
            if rendered != num_images:
                raise TokenizeRejected(
                    TokenizeDropReason.TEMPLATE_ERROR,
                    f"the template rendered {rendered} image token(s) for {num_images} images",
                )
            counts = self.image_token_counts(image_sizes[:num_images])
            ids, mask = expand_image_tokens(ids, mask, self.image_token_id, counts)
        full_length = len(ids)
        ids, mask, truncated = truncate(ids, mask, self.max_length, self.image_token_id)
        return TokenizedRow(ids, mask, num_turns, num_images, truncated, full_length)

    def reply_rows(
        self,
        turns: Sequence[Turn],
        replies: Sequence[tuple[int, Sequence[int]]],
        special_ids: set[int],
        image_sizes: Sequence[tuple[int, int]] = (),
    ) -> list[TokenizedRow]:
        """One row per regenerated reply, made of exactly what the target read and wrote:
        the conversation before the reply rendered with the generation prompt (earlier
        replies as their text, as vLLM tokenized them when it was asked), the ids it
        generated, and the tokens the template closes the turn with. For conversations
        whose full render re-tokenizes a reply differently: one row for the whole
        conversation would put ids the target never read before later replies."""
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


def without_trailing(ids: Sequence[int], special_ids: set[int]) -> list[int]:
    """`ids` without the special tokens at their end (the stop token a reply ends with;
    the template writes its own)."""
    out = list(ids)
    while out and out[-1] in special_ids:
        out.pop()
    return out


def supervised_runs(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """The [start, end) spans of consecutive supervised tokens, in order."""
    runs, start = [], None
    for position, flag in enumerate([*loss_mask, 0]):
        if flag and start is None:
            start = position
        elif not flag and start is not None:
            runs.append((start, position))
            start = None
    return runs


def check_generated_ids(
    row: TokenizedRow, replies: Sequence[tuple[int, Sequence[int]]], special_ids: set[int]
) -> int:
    """The trainer must see exactly the tokens the target generated. `replies` are
    (turn index, generated ids) of the regenerated turns; each supervised run of the row
    (the last ones it covers: a row per turn supervises only its last) must begin with
    the reply's ids, without the stop token the template writes itself. A template whose
    re-tokenization of the decoded text differs (merges across the boundary, stripped
    whitespace) is refused. Returns the number of replies checked."""
    covered = [
        without_trailing(ids, special_ids) for index, ids in replies if index < row.num_turns
    ]
    runs = supervised_runs(row.loss_mask)
    if len(runs) > len(covered):
        raise TokenizeRejected(
            TokenizeDropReason.RETOKENIZATION_MISMATCH,
            f"{len(runs)} supervised spans for {len(covered)} generated replies",
        )
    last = covered[len(covered) - len(runs) :]
    for n, ((start, end), ids) in enumerate(zip(runs, last, strict=True)):
        got = row.input_ids[start:end]
        cut = row.truncated and end == len(row.input_ids)
        expected = ids[: len(got)] if cut else ids
        if got[: len(expected)] != expected:
            raise TokenizeRejected(
                TokenizeDropReason.RETOKENIZATION_MISMATCH,
                f"reply {n}: {first_mismatch(got, expected)}",
            )
    return len(runs)


def first_mismatch(got: Sequence[int], expected: Sequence[int]) -> str:
    for position, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b:
            return f"token {position}: template gives {a}, the target generated {b}"
    return f"template gives {len(got)} tokens, the target generated {len(expected)}"


def tokenize_with_pixels(processor: ProcessorMixin, turns: Sequence[Turn]) -> dict[str, list]:
    """The eager reference: the processor decodes every image. Used by tests and the
    benchmark to check and measure the lazy path, never by the pipeline."""
    from PIL import Image

    def decoded(path: str) -> Image.Image:
        # Pillow, not transformers' loader: its torchvision decoder needs compiled ops
        # that the CPU build here lacks.
        with Image.open(path) as image:
            return image.convert("RGB")

    conv = [
        {
            **t,
            "content": [
                {"type": "image", "image": decoded(p["path"])} if p["type"] == "image" else p
                for p in t["content"]
            ],
        }
        if isinstance(t["content"], list)
        else t
        for t in turns
    ]
    has_markers = bool(GENERATION_MARKER.search(processor.chat_template or ""))
    out = processor.apply_chat_template(
        conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=has_markers
    )
    ids = out["input_ids"]
    ids = ids[0] if ids and isinstance(ids[0], list) else ids
    result = {"input_ids": list(ids)}
    if has_markers:
        mask = out["assistant_masks"]
        result["loss_mask"] = list(mask[0] if mask and isinstance(mask[0], list) else mask)
    return result


def render_supervision(
    tokenizer: PreTrainedTokenizerBase,
    ids: Sequence[int],
    mask: Sequence[int],
    image_token_id: int | None = None,
) -> str:
    """Decoded text with supervised spans in ⟦…⟧ and image blocks collapsed, for the UI."""
    pieces: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        if image_token_id is not None and ids[i] == image_token_id:
            while j < len(ids) and ids[j] == image_token_id:
                j += 1
            pieces.append(f"<image ×{j - i}>")
        else:
            while (
                j < len(ids)
                and mask[j] == mask[i]
                and (image_token_id is None or ids[j] != image_token_id)
            ):
                j += 1
            text = tokenizer.decode(list(ids[i:j]), skip_special_tokens=False)
            pieces.append(f"⟦{text}⟧" if mask[i] else text)
        i = j
    return "".join(pieces)
