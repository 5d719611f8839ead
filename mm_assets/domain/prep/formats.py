"""The record layouts a registry entry's `format` names: where a record keeps its turns
and its images, read into the normalized turns, with a reason for every rejected row.

Images come either inline in a part (a reference in `image`/`path`/`url`, or an
`image_url`) or, in TRL's layout, as `{"type": "image"}` parts matched in order to the
record's `images` column. Every column image must meet a part and every such part an
image: a row that does not pair up is quarantined, never paired by guess, since an image
shown next to the wrong turn trains the draft on a conversation nobody had.

A `prompts` record names its prompt, image(s) and reference answer(s) in the columns the
entry's `columns` gives (MT-Bench's two turns, MMStar's question and image).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

from mm_assets.domain.ingest.images import ImageProbe
from mm_assets.domain.rejection import RowRejected
from mm_assets.registry.specs import PromptColumns

IMAGE_PLACEHOLDER = "<image>"
_PLACEHOLDER = re.compile(f"\n?({re.escape(IMAGE_PLACEHOLDER)})\n?")  # with its newlines
IMAGES_COLUMN = "images"  # TRL's layout: the images its `{"type": "image"}` parts show
_INLINE_KEYS = ("image", "path", "url")

ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    **dict.fromkeys(("human", "user"), "user"),
    **dict.fromkeys(("gpt", "assistant", "chatgpt", "bard", "bing", "model"), "assistant"),
    **dict.fromkeys(("tool", "function", "observation", "ipython"), "tool"),
}


class DropReason(StrEnum):
    MALFORMED_ROW = "malformed_row"
    EMPTY_CONVERSATION = "empty_conversation"
    NO_ASSISTANT_TURN = "no_assistant_turn"
    NO_USER_TURN = "no_user_turn"
    EMPTY_ASSISTANT_TURN = "empty_assistant_turn"
    UNKNOWN_ROLE = "unknown_role"
    IMAGE_PLACEHOLDER_MISMATCH = "image_placeholder_mismatch"
    IMAGE_UNAVAILABLE = "image_unavailable"
    DUPLICATE_SAMPLE = "duplicate_sample"


class Rejected(RowRejected):
    """A row that cannot be used, with the reason recorded in the quarantine."""


Turn = dict[str, Any]


# -- image references ------------------------------------------------------------


def column_references(value: Any, column: str, strict: bool = True) -> list[str]:
    """A column's image references: one reference or a list of them (None: no image).
    A reference is a string, or a dict naming one (`{"path": ...}`, as the hub's image
    feature stores a file)."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    refs = []
    for index, item in enumerate(values):
        ref = _as_reference(item)
        if ref is None:
            if strict:
                raise Rejected(
                    DropReason.MALFORMED_ROW,
                    f"'{column}' entry {index} is {_shown(item)}, not an image reference",
                )
            continue
        refs.append(ref)
    return refs


def _as_reference(value: Any) -> str | None:
    if isinstance(value, str):
        return value or None
    if isinstance(value, dict):
        return next((v for k in ("path", "url") if isinstance(v := value.get(k), str) and v), None)
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _turn_list(record: Mapping[str, Any], key: str = "messages", strict: bool = True) -> list:
    """The record's turns under `key` (a `messages` record may name them `conversations`)."""
    turns = record.get(key, record.get("conversations"))
    if not isinstance(turns, list):
        if strict:
            raise Rejected(
                DropReason.MALFORMED_ROW,
                f"'{key}' is a {type(turns).__name__}, expected a list of turns",
            )
        return []
    return turns


def messages_image_refs(record: Mapping[str, Any], strict: bool) -> list[str]:
    """Inline references and `images` column entries in the order the parts show them;
    column entries no part shows come last (normalization quarantines such a row)."""
    column = iter(column_references(record.get(IMAGES_COLUMN), IMAGES_COLUMN, strict))
    refs = []
    for message in _turn_list(record, strict=strict):
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            ref = _part_image_ref(part)
            if ref is None and _is_image_slot(part):
                ref = next(column, None)
            if ref is not None:
                refs.append(ref)
    return refs + list(column)


def _part_image_ref(part: Any) -> str | None:
    """An image part's inline reference. Hub datasets store parts as one struct, so every
    part holds every key and the absent ones are None: the first key set is the one."""
    if not isinstance(part, dict):
        return None
    if part.get("type") == "image":
        return next((_as_reference(part[k]) for k in _INLINE_KEYS if part.get(k) is not None), None)
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return None


def _is_image_slot(part: Any) -> bool:
    """TRL's `{"type": "image"}`: an image part with no reference of its own, showing the
    next image of the `images` column."""
    return isinstance(part, dict) and part.get("type") == "image" and _part_image_ref(part) is None


# -- normalizers, selected by the registry entry's `format` ------------------------


def _role(raw: Any) -> str:
    role = ROLE_ALIASES.get(str(raw).strip().lower()) if isinstance(raw, str) else None
    if role is None:
        raise Rejected(
            DropReason.UNKNOWN_ROLE,
            f"role {raw!r}; known: {sorted(ROLE_ALIASES)} (map it in ROLE_ALIASES)",
        )
    return role


def image_part(probe: ImageProbe) -> dict[str, Any]:
    """An image part: the file the probe checked and its content hash."""
    return {"type": "image", "path": probe.path, "sha256": probe.content_hash}


def _split_placeholders(text: str, images: list[ImageProbe], cursor: list[int]) -> list[dict]:
    """Text with `<image>` placeholders as parts; the newline that separates a
    placeholder from its text belongs to the placeholder."""
    parts: list[dict] = []
    for segment in _PLACEHOLDER.split(text):
        if segment != IMAGE_PLACEHOLDER:
            parts += [{"type": "text", "text": segment}] if segment else []
            continue
        if cursor[0] >= len(images):
            raise Rejected(
                DropReason.IMAGE_PLACEHOLDER_MISMATCH,
                f"more {IMAGE_PLACEHOLDER} placeholders than the {len(images)} image(s)",
            )
        parts.append(image_part(images[cursor[0]]))
        cursor[0] += 1
    return parts


def _from_value_turns(
    record: Mapping[str, Any], images: list[ImageProbe], with_placeholders: bool
) -> list[Turn]:
    cursor = [0]
    turns: list[Turn] = []
    for index, turn in enumerate(_turn_list(record, "conversations")):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise Rejected(DropReason.MALFORMED_ROW, f"turn {index} has no string 'value'")
        role = _role(turn.get("from"))
        value = turn["value"]
        if with_placeholders and IMAGE_PLACEHOLDER in value:
            if role != "user":
                raise Rejected(
                    DropReason.IMAGE_PLACEHOLDER_MISMATCH,
                    f"{IMAGE_PLACEHOLDER} in a {role} turn (turn {index})",
                )
            turns.append({"role": role, "content": _split_placeholders(value, images, cursor)})
        else:
            turns.append({"role": role, "content": value})
    if cursor[0] != len(images):
        raise Rejected(
            DropReason.IMAGE_PLACEHOLDER_MISMATCH,
            f"{len(images)} image(s) but {cursor[0]} {IMAGE_PLACEHOLDER} placeholder(s)",
        )
    return turns


def _messages(
    record: Mapping[str, Any], images: list[ImageProbe], columns: PromptColumns
) -> list[Turn]:
    """OpenAI/TRL messages; `images` in the order `messages_image_refs` lists them."""
    pending = iter(images)
    column = column_references(record.get(IMAGES_COLUMN), IMAGES_COLUMN)
    slots = 0
    turns: list[Turn] = []
    for index, message in enumerate(_turn_list(record)):
        if not isinstance(message, dict):
            raise Rejected(DropReason.MALFORMED_ROW, f"turn {index} is not an object")
        role = _role(message.get("role"))
        content = message.get("content")
        if isinstance(content, str):
            turns.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise Rejected(DropReason.MALFORMED_ROW, f"turn {index} content is not text or parts")
        parts = []
        for part in content:
            if _is_image_slot(part):
                slots += 1
                if slots > len(column):
                    raise Rejected(
                        DropReason.IMAGE_PLACEHOLDER_MISMATCH,
                        f"more {{'type': 'image'}} parts than the {len(column)} image(s) in "
                        f"the '{IMAGES_COLUMN}' column (turn {index})",
                    )
                parts.append(image_part(next(pending)))
            elif _part_image_ref(part) is not None:
                parts.append(image_part(next(pending)))
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise Rejected(DropReason.MALFORMED_ROW, f"turn {index} has an unknown part")
        turns.append({"role": role, "content": parts})
    if slots < len(column):
        raise Rejected(
            DropReason.IMAGE_PLACEHOLDER_MISMATCH,
            f"{len(column)} image(s) in the '{IMAGES_COLUMN}' column but {slots} "
            f"{{'type': 'image'}} part(s): {len(column) - slots} left unused",
        )
    return turns


def _prompts(
    record: Mapping[str, Any], images: list[ImageProbe], columns: PromptColumns
) -> list[Turn]:
    """The prompt turn(s), the image(s) before the first one's text, and the reference
    answers (when the entry names a column for them) as assistant turns."""
    prompts = _prompt_texts(record, columns.prompt)
    if columns.image is not None:  # `images` holds its usable entries: refuse the others
        column_references(record.get(columns.image), columns.image)
    answers = _answer_texts(record, columns.answer, len(prompts))
    turns: list[Turn] = []
    for index, text in enumerate(prompts):
        content: str | list[dict[str, Any]] = text
        if index == 0 and images:
            content = [
                *(image_part(p) for p in images),
                {"type": "text", "text": text},
            ]
        turns.append({"role": "user", "content": content})
        if answers:
            turns.append({"role": "assistant", "content": answers[index]})
    return turns


def _prompt_texts(record: Mapping[str, Any], column: str) -> list[str]:
    value = record.get(column)
    if value is None:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise Rejected(
            DropReason.MALFORMED_ROW,
            f"no prompt in column {column!r} (the record's columns: {keys}; set the "
            f"entry's columns.prompt)",
        )
    texts = _strings(value if isinstance(value, list) else [value], column, "turn")
    if not texts:
        raise Rejected(DropReason.MALFORMED_ROW, f"{column!r} is an empty list of turns")
    for index, text in enumerate(texts):
        if not text.strip():
            raise Rejected(DropReason.MALFORMED_ROW, f"{column!r} turn {index} is empty")
    return texts


def _strings(values: list[Any], column: str, noun: str) -> list[str]:
    for index, text in enumerate(values):
        if not isinstance(text, str):
            raise Rejected(
                DropReason.MALFORMED_ROW,
                f"{column!r} {noun} {index} is {_shown(text)}, expected a string",
            )
    return values


def _answer_texts(record: Mapping[str, Any], column: str | None, turns: int) -> list[str]:
    """One answer per prompt turn, or none (no column, or the row holds no answer)."""
    value = None if column is None else record.get(column)
    if value is None or value == []:
        return []
    if isinstance(value, str):
        if turns != 1:
            raise Rejected(
                DropReason.MALFORMED_ROW,
                f"{column!r} is one string for {turns} prompt turns: expected a list, "
                f"one answer per turn",
            )
        return [value]
    if not isinstance(value, list) or len(value) != turns:
        got = f"{len(value)} answers" if isinstance(value, list) else _shown(value)
        raise Rejected(
            DropReason.MALFORMED_ROW,
            f"{column!r}: expected one answer per prompt turn ({turns}), got {got}",
        )
    return _strings(value, column, "answer")


Normalizer = Callable[[Mapping[str, Any], list[ImageProbe], PromptColumns], list[Turn]]
NORMALIZERS: dict[str, Normalizer] = {
    "sharegpt4v": lambda record, images, _: _from_value_turns(record, images, True),
    "sharegpt": lambda record, images, _: _from_value_turns(record, images, False),
    "messages": _messages,
    "prompts": _prompts,
}
