"""Normalizing dataset records into one conversation form, with a reason for every drop.

Normalized form: a list of turns `{"role": system|user|assistant|tool, "content": ...}`
where content is a string or a list of parts `{"type": "text", "text": ...}` /
`{"type": "image", "path": <absolute path>, "sha256": <its probe's content hash>}`.

Unknown roles quarantine the whole row rather than being dropped or guessed: a turn
silently removed or relabelled would train the draft on a conversation shape the target
never serves. Assistant turns before the first user turn (a conversation scraped mid-way)
are context the target reads, never supervised nor regenerated (`reply_indices`).
Where each `format` keeps its turns and images: `formats.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mm_assets.common.hashing import json_sha256
from mm_assets.common.urls import probed_file_url
from mm_assets.domain.ingest.images import ImageProbe
from mm_assets.domain.prep.formats import (
    NORMALIZERS,
    DropReason,
    Rejected,
    Turn,
    column_references,
    messages_image_refs,
)
from mm_assets.registry.specs import PromptColumns

__all__ = ["NORMALIZERS", "DropReason", "Rejected", "Turn"]


@dataclass(frozen=True)
class Conversation:
    turns: list[Turn]
    images: list[ImageProbe]  # in the order their parts appear

    @property
    def multimodal(self) -> bool:
        return bool(self.images)

    def sample_id(self) -> str:
        """Stable across reruns, row order and moves of the image root."""
        return json_sha256(canonical_turns(self.turns, [p.content_hash for p in self.images]))[:20]


def canonical_turns(turns: list[Turn], image_hashes: list[str]) -> list[Turn]:
    """The turns with each image part replaced by its content hash (in part order), so a
    hash of them names the content, wherever the images lie."""
    hashes = iter(image_hashes)
    return map_parts(
        turns,
        lambda p: {"type": "image", "sha256": next(hashes)} if p.get("type") == "image" else p,
    )


def map_parts(turns: Sequence[Turn], part: Callable[[Any], Any]) -> list[Turn]:
    """Copies of the turns with `part` applied to each part of a list content."""
    return [
        {**t, "content": [part(p) for p in t["content"]]}
        if isinstance(t["content"], list)
        else dict(t)
        for t in turns
    ]


# -- reading records -------------------------------------------------------------


def parse_record(record_json: str, parse_error: str | None = None) -> dict[str, Any]:
    if parse_error is not None:
        raise Rejected(DropReason.MALFORMED_ROW, parse_error)
    try:
        record = json.loads(record_json)
    except json.JSONDecodeError as exc:
        raise Rejected(DropReason.MALFORMED_ROW, f"invalid JSON: {exc}") from exc
    if not isinstance(record, dict):
        raise Rejected(
            DropReason.MALFORMED_ROW, f"record is a {type(record).__name__}, not an object"
        )
    return record


def image_references(
    record: Mapping[str, Any], fmt: str, columns: PromptColumns | None = None
) -> list[str]:
    """The image references a record names, in part order (for the availability stage).
    Unusable entries are skipped here: normalization quarantines their row."""
    if fmt == "sharegpt4v":
        image = record.get("image")
        if image is None:
            return []
        return list(image) if isinstance(image, list) else [image]
    if fmt == "messages":
        return messages_image_refs(record, strict=False)
    if fmt == "prompts":
        column = (columns or PromptColumns()).image
        if column is None:
            return []
        return column_references(record.get(column), column, strict=False)
    return []


def normalize(
    record: Mapping[str, Any],
    fmt: str,
    probes: Mapping[str, ImageProbe],
    columns: PromptColumns | None = None,
    *,
    benchmark: bool = False,
) -> Conversation:
    """The normalized conversation of one record, or `Rejected` with the reason.

    A `benchmark` row needs a user turn but no reply: its replies are the target's,
    written when a draft is measured on it; a training row without one has nothing to
    train on."""
    if fmt not in NORMALIZERS:
        raise ValueError(f"unknown format {fmt!r}; known: {sorted(NORMALIZERS)}")
    columns = columns or PromptColumns()
    refs = image_references(record, fmt, columns)
    images = []
    for ref in refs:
        probe = probes.get(str(ref))
        if probe is None or not probe.ok:
            status = probe.status.value if probe else "not probed"
            raise Rejected(DropReason.IMAGE_UNAVAILABLE, f"{ref}: {status}")
        images.append(probe)
    turns = NORMALIZERS[fmt](record, images, columns)
    if not turns:
        raise Rejected(DropReason.EMPTY_CONVERSATION, "no turns")
    if benchmark:
        if not any(t["role"] == "user" for t in turns):
            raise Rejected(DropReason.NO_USER_TURN, "a benchmark row needs a user turn to ask")
    elif not reply_indices(turns):
        where = "after a user turn" if any(t["role"] == "assistant" for t in turns) else ""
        raise Rejected(DropReason.NO_ASSISTANT_TURN, f"no assistant turn {where}".strip())
    for index, turn in enumerate(turns):
        # an empty answer would supervise only the template's end-of-turn token: it
        # teaches the draft to stop, and breaks the conversation the next turns continue
        if turn["role"] == "assistant" and not turn_text(turn).strip():
            raise Rejected(DropReason.EMPTY_ASSISTANT_TURN, f"turn {index} has no text")
    return Conversation(turns, images)


def turn_text(turn: Turn) -> str:
    """A turn's text (its text parts joined; image parts carry none)."""
    content = turn["content"]
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p["type"] == "text")


def to_vllm_messages(turns: list[Turn]) -> list[dict[str, Any]]:
    """OpenAI chat messages for vLLM: image parts as `file://` URLs (never pixels),
    percent-encoded (`Path.as_uri`) so that vLLM, which parses the URL, opens the file the
    probe checked: `a#b.png` would otherwise be read as `a`, `%41` as `A`. The probe's
    content hash rides as the fragment (`#sha256=<hex>`): the client checks it when it
    sends the file inline (`clients/media_urls.py`), and sends the server no fragment."""

    def part(p: dict[str, Any]) -> dict[str, Any]:
        if p["type"] == "image":
            url = probed_file_url(p["path"], p.get("sha256"))
            return {"type": "image_url", "image_url": {"url": url}}
        return {"type": "text", "text": p["text"]}

    return [
        {"role": t["role"], "content": t["content"]}
        if isinstance(t["content"], str)
        else {"role": t["role"], "content": [part(p) for p in t["content"]]}
        for t in turns
    ]


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The image URLs of `to_vllm_messages` output, in order."""
    return [
        part["image_url"]["url"]
        for message in messages
        if not isinstance(message["content"], str)
        for part in message["content"]
        if part["type"] == "image_url"
    ]


def _first_user_turn(turns: Sequence[Turn]) -> int:
    return next((i for i, t in enumerate(turns) if t["role"] == "user"), len(turns))


def reply_indices(turns: Sequence[Turn]) -> list[int]:
    """The assistant turns that answer something: those after the first user turn."""
    first_user = _first_user_turn(turns)
    return [i for i in range(first_user + 1, len(turns)) if turns[i]["role"] == "assistant"]


def opens_with_assistant(turns: Sequence[Turn]) -> bool:
    return any(t["role"] == "assistant" for t in turns[: _first_user_turn(turns)])


def reply_prompts(turns: list[Turn], turn_index: int | None = None) -> list[tuple[int, list[Turn]]]:
    """(assistant turn index, the turns before it) for each reply of a training row, or
    only the one at `turn_index` for a per-turn row."""
    indices = reply_indices(turns)
    if turn_index is not None:
        indices = [i for i in indices if i == turn_index]
    return [(i, turns[:i]) for i in indices]
