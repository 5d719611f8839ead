"""On-policy responses: the target rewrites every assistant turn of a conversation.

A draft learns to predict the target's next token, so it must learn from text the target
wrote, not answers someone else wrote. The prompt of the assistant turn at index k is the
conversation before k with every earlier reply already the target's own, images
included; user turns stay as the dataset wrote them, and so do assistant turns before
the first user turn (context, not replies). Turns are generated in order.

A conversation whose first reply fails or comes back empty is quarantined with the
reason; one that fails later keeps the turns before the failing exchange. A reply cut by
`max_tokens` is kept: it is still what the target writes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import Field, FiniteFloat

from mm_assets.common.hashing import json_sha256
from mm_assets.common.request_settings import RequestSettings
from mm_assets.domain.prep.conversations import Turn, canonical_turns, reply_indices
from mm_assets.domain.rejection import RowRejected

RESPONSES_VERSION = "2"  # 2: a reply cut by max_tokens is kept even with no text yet


class ResponseSettings(RequestSettings):
    """Knobs of a regeneration run (the `target_responses` asset's config). Greedy by
    default, as the default evaluation decodes greedily."""

    temperature: FiniteFloat = Field(default=0.0, ge=0, description="0 = greedy.")
    top_p: FiniteFloat = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    seed: int = Field(default=0, description="Sampling seed (per request).")
    max_tokens: int = Field(default=256, ge=1, description="Longest reply per turn.")
    system_prompt: str | None = Field(
        default=None,
        description="None keeps each conversation's system turn; a text replaces it (or "
        "is added first); an empty text removes it.",
    )
    max_response_quarantine_ratio: FiniteFloat = Field(
        default=0.05,
        ge=0,
        le=1,
        description="The blocking check on target_responses fails when more of the "
        "conversations than this are quarantined.",
    )

    def sampling(self) -> dict[str, Any]:
        """The Chat Completions sampling fields."""
        return self.model_dump(include={"temperature", "top_p", "seed", "max_tokens"})


class ResponseProblem(StrEnum):
    EMPTY_RESPONSE = "empty_response"
    PROMPT_TOO_LONG = "prompt_too_long"
    GENERATION_ERROR = "generation_error"


class ResponseRejected(RowRejected):
    """A conversation the target could not answer, with the reason."""


def refusal_problem(status: int | None, message: str) -> ResponseProblem:
    """A refused request: a prompt longer than the model's context is its own reason
    (it fails the same way every time); anything else is a generation error."""
    too_long = ("maximum context length", "longer than the maximum model length")  # vLLM's
    if status == 400 and any(text in message.lower() for text in too_long):
        return ResponseProblem.PROMPT_TOO_LONG
    return ResponseProblem.GENERATION_ERROR


def with_system_prompt(turns: list[Turn], system_prompt: str | None) -> list[Turn]:
    """Apply the policy of `ResponseSettings.system_prompt`."""
    if system_prompt is None:
        return list(turns)
    rest = [t for t in turns if t["role"] != "system"]
    return [{"role": "system", "content": system_prompt}, *rest] if system_prompt else rest


def response_key(
    target_fingerprint: str,
    dtype: str,
    settings: ResponseSettings,
    turns: list[Turn],
    image_hashes: list[str],
) -> str:
    """What the replies depend on: the target and the dtype it is served at, the sampling
    settings and the prompt side of the conversation, so a rerun, a reordering or an
    edit of another row reuses them."""
    prompt = prompt_side(with_system_prompt(turns, settings.system_prompt), image_hashes)
    sampling = {**settings.sampling(), "system_prompt": settings.system_prompt}
    return json_sha256([RESPONSES_VERSION, target_fingerprint, dtype, sampling, prompt])


def prompt_side(turns: list[Turn], image_hashes: list[str]) -> list[Turn]:
    """The canonical turns with the replies' text left out (images by content)."""
    canonical = canonical_turns(turns, image_hashes)
    replies = set(reply_indices(canonical))
    return [{"role": "assistant"} if i in replies else t for i, t in enumerate(canonical)]


@dataclass(frozen=True)
class Reply:
    """The target's reply to the turn at `index`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class Regeneration:
    """The replies of one conversation so far, and why it stopped early (if it did)."""

    replies: list[Reply] = field(default_factory=list)
    problem: ResponseProblem | None = None
    detail: str = ""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)  # the problem, a StrEnum, is written as its value

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Regeneration:
        problem = ResponseProblem(data["problem"]) if data["problem"] else None
        return cls([Reply(**r) for r in data["replies"]], problem, data["detail"])


def prompt_before(turns: list[Turn], index: int, replies: list[Reply]) -> list[Turn]:
    """The conversation before the turn at `index`, earlier assistant turns replaced by
    the target's replies."""
    return apply_replies(turns[:index], replies)


def apply_replies(turns: list[Turn], replies: list[Reply]) -> list[Turn]:
    """The turns with each replied assistant turn's content replaced by the reply."""
    texts = {r.index: r.text for r in replies}
    return [
        {"role": t["role"], "content": texts[i]} if i in texts else t for i, t in enumerate(turns)
    ]


def regenerated_turns(turns: list[Turn], regeneration: Regeneration) -> list[Turn]:
    """The conversation as the target would have held it: up to its last reply (later
    turns, when the run stopped early, are dropped). Quarantined (`ResponseRejected`)
    when not even the first assistant turn got a reply."""
    if not regeneration.replies:
        problem = regeneration.problem or ResponseProblem.GENERATION_ERROR
        raise ResponseRejected(problem, regeneration.detail or "no reply")
    last = regeneration.replies[-1].index
    return apply_replies(turns[: last + 1], regeneration.replies)


def check_reply(text: str, finish_reason: str) -> None:
    """A reply the target ended having said nothing (no text after stripping) teaches the
    draft nothing but to end answers at once. One cut by `max_tokens` is not that: its
    tokens may be byte pieces that decode to no text yet (a small or random model's),
    and they are what the target writes."""
    if not text.strip() and finish_reason != "length":
        raise ResponseRejected(ResponseProblem.EMPTY_RESPONSE, "the target answered nothing")
