"""What the demo target is taught, and the questions its answers are checked on.

The demo's generator knows the truth of every picture and every text answer, so a target
trained on conversations it writes answers in sentences that depend on the picture. Every
lesson comes from this module's own seeded stream of new pictures and questions, kept
apart from what the demo later measures by `Exclusions`: no picture the demo datasets or
the benchmark draw, no conversation whose user turns equal one of theirs, and no
held-out check question. Facts (a hexagon has six sides) are shared, as a real model's
knowledge is; the questions and pictures it is judged on are not.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mm_assets.demo import data, images
from mm_assets.demo.images import ImageSpec, Shape

__all__ = [
    "Check",
    "Exclusions",
    "Lesson",
    "as_messages",
    "check_exclusions",
    "checks",
    "demo_exclusions",
    "last_named",
    "lessons",
    "picture_key",
    "prompt_key",
]

# Picture ids (file names) of the lessons and checks, above every id the demo datasets and
# benchmark draw (`images.image_specs` samples below 581,930). What a picture shows is kept
# apart by `Exclusions`, which compare `picture_key`s.
LESSON_IDS = range(1_000_000, 9_000_000)
CHECK_IDS = range(9_000_000, 9_500_000)

BACKGROUND_QUESTIONS = ("What colour is the background?", "Which colour is the background?")
COUNT_QUESTIONS = ("How many shapes are there?", "How many shapes can you see?")
SHAPE_COLOUR_QUESTIONS = ("What colour is the {kind}?", "Which colour is the {kind}?")


@dataclass(frozen=True)
class Lesson:
    """One conversation to train on: its picture (if any) is shown before the first user
    turn's text; `turns` alternate user and assistant, after an optional system turn."""

    turns: tuple[tuple[str, str], ...]  # (role, text)
    picture: ImageSpec | None = None


@dataclass(frozen=True)
class Check:
    """One held-out question with what a right answer names (`truth`): the answer's last
    word matching `answers` (a regular expression of the words that may answer it)."""

    kind: str  # background | count | shape_colour | text
    question: str
    truth: str
    answers: str
    chance: float  # a uniform guess among those words
    picture: ImageSpec | None = None

    def is_right(self, answer: str) -> bool:
        return last_named(answer, self.answers) == self.truth


@dataclass
class Exclusions:
    """What no lesson may hold: pictures, and conversations by their user turns."""

    pictures: set[tuple[Any, ...]] = field(default_factory=set)  # `picture_key`s
    prompts: set[tuple[str, ...]] = field(default_factory=set)  # `prompt_key`s

    def allows(self, lesson: Lesson) -> bool:
        """A lesson with a picture is new when its picture is (its questions are then
        asked about something never seen); one without, when its user turns are."""
        if lesson.picture is not None:
            return picture_key(lesson.picture) not in self.pictures
        return prompt_key(lesson.turns) not in self.prompts

    def update(self, other: Exclusions) -> None:
        self.pictures |= other.pictures
        self.prompts |= other.prompts


def prompt_key(turns: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """A conversation's user turns, the part a benchmark or a held-out row asks."""
    return tuple(text for role, text in turns if role == "user")


def last_named(answer: str, words: str) -> str | None:
    """The last whole word of `answer` matching `words` (answers restate their operands:
    'You have 3 + 4 = 7 balls'); `six` is not found in `sixteen`, nor `4` in `-4`."""
    found = re.findall(rf"(?<![\w-])(?:{words})(?![\w-])", answer)
    return found[-1] if found else None


def picture_key(spec: ImageSpec) -> tuple[Any, ...]:
    """What a picture looks like, whatever its id: two specs with one key draw the same."""
    return (spec.width, spec.height, spec.fmt, spec.mode, spec.background, spec.shapes)


def _unique_kinds(spec: ImageSpec) -> list[Shape]:
    """The shapes whose kind appears once in the picture, so 'the circle' names one."""
    kinds = [s.kind for s in spec.shapes]
    return [s for s in spec.shapes if kinds.count(s.kind) == 1]


def _picture_exchanges(rng: random.Random, spec: ImageSpec) -> list[tuple[str, str]]:
    """Questions whose answers follow from the picture: the demo datasets' own (a
    description, the follow-ups) and the three the checks ask."""
    n = len(spec.shapes)
    exchanges = [
        (rng.choice(BACKGROUND_QUESTIONS), f"The background is {spec.background}."),
        (
            rng.choice(COUNT_QUESTIONS),
            f"There {'is' if n == 1 else 'are'} {data._plural(n, 'shape')} in the picture.",
        ),
        *data._follow_ups(rng, spec),
    ]
    for shape in _unique_kinds(spec):
        question = rng.choice(SHAPE_COLOUR_QUESTIONS).format(kind=shape.kind)
        exchanges.append((question, f"The {shape.kind} is {shape.colour}."))
    return exchanges


def _picture_lesson(rng: random.Random, spec: ImageSpec) -> Lesson:
    """Two to five exchanges about one picture, sometimes a description first: the
    pixels are processed once for several answers that depend on them."""
    pool = _picture_exchanges(rng, spec)
    rng.shuffle(pool)
    if rng.random() < 0.25:
        pool.insert(0, (rng.choice(data.FIRST_PROMPTS), data._describe(rng, spec)))
    turns: list[tuple[str, str]] = []
    for question, answer in pool[: rng.randint(2, 5)]:
        turns += [("user", question), ("assistant", answer)]
    return Lesson(tuple(turns), spec)


def _text_lesson(rng: random.Random) -> Lesson:
    """The text tasks of `demo_sharegpt`, 1-3 exchanges, sometimes after a system turn."""
    turns: list[tuple[str, str]] = []
    if rng.random() < 0.25:
        turns.append(("system", rng.choice(data._SYSTEM_PROMPTS)))
    for _ in range(rng.choice((1, 1, 2, 3))):
        question, answer = data._text_exchange(rng)
        turns += [("user", question), ("assistant", answer)]
    return Lesson(tuple(turns))


def _pictures(rng: random.Random, ids: range) -> Iterator[ImageSpec]:
    """Endless new pictures drawn like the demo's, with ids from `ids`."""
    while True:
        for spec in images.image_specs(rng, 256):
            yield ImageSpec(
                rng.randrange(ids.start, ids.stop),
                spec.width,
                spec.height,
                spec.fmt,
                spec.mode,
                spec.background,
                spec.shapes,
            )


def lessons(n: int, seed: int, exclusions: Exclusions, picture_share: float = 0.6) -> list[Lesson]:
    """`n` lessons, `picture_share` of them about a picture; same arguments, same list."""
    rng = random.Random(seed)
    pictures = _pictures(random.Random(seed + 1), LESSON_IDS)
    out: list[Lesson] = []
    while len(out) < n:
        lesson = (
            _picture_lesson(rng, next(pictures))
            if rng.random() < picture_share
            else _text_lesson(rng)
        )
        if exclusions.allows(lesson):
            out.append(lesson)
    return out


def checks(n_pictures: int, n_text: int, seed: int, exclusions: Exclusions) -> list[Check]:
    """Held-out questions: per picture its background, its number of shapes and the
    colour of a shape named by its kind (one whose kind is unique there); text tasks,
    each asked once. Held out from the lessons by `check_exclusions`; the pictures are
    new to the demo too, the text questions may be ones a demo dataset also asks."""
    rng = random.Random(seed)
    colours = sorted(images.COLOURS)
    counts = "|".join(data.NUMBER_WORDS[1:5])
    out: list[Check] = []
    pictures = _pictures(random.Random(seed + 1), CHECK_IDS)
    made = 0
    while made < n_pictures:
        spec = next(pictures)
        if picture_key(spec) in exclusions.pictures or not (named := _unique_kinds(spec)):
            continue
        made += 1
        shape = rng.choice(named)
        question = rng.choice(SHAPE_COLOUR_QUESTIONS).format(kind=shape.kind)
        out += [
            Check(
                "background",
                rng.choice(BACKGROUND_QUESTIONS),
                spec.background,
                "|".join(colours),
                1 / len(colours),
                spec,
            ),
            Check(
                "count",
                rng.choice(COUNT_QUESTIONS),
                data.NUMBER_WORDS[len(spec.shapes)],
                counts,
                1 / 4,  # one to four shapes
                spec,
            ),
            # the shape's colour is never the background's
            Check("shape_colour", question, shape.colour, "|".join(colours), 1 / 11, spec),
        ]
    asked: set[str] = set()
    while len(asked) < n_text:
        task = data.text_task(rng)
        if task.question in asked:
            continue
        asked.add(task.question)
        out.append(Check("text", task.question, task.truth, task.answers, task.chance))
    return out


def check_exclusions(found: Iterable[Check]) -> Exclusions:
    """The checks as exclusions: their pictures and their questions asked alone."""
    result = Exclusions()
    for check in found:
        if check.picture is not None:
            result.pictures.add(picture_key(check.picture))
        else:
            result.prompts.add((check.question,))
    return result


def as_messages(lesson: Lesson | Check, image: Any) -> list[dict[str, Any]]:
    """Chat messages for a processor's template: the picture before the first user text."""
    turns = lesson.turns if isinstance(lesson, Lesson) else (("user", lesson.question),)
    messages: list[dict[str, Any]] = []
    shown = False
    for role, text in turns:
        content: list[dict[str, Any]] = []
        if role == "user" and not shown and image is not None:
            content.append({"type": "image", "image": image})
            shown = True
        content.append({"type": "text", "text": text})
        messages.append({"role": role, "content": content})
    return messages


def demo_exclusions(
    pictures: Iterable[ImageSpec], conversations: Iterable[Iterable[tuple[str, str]]]
) -> Exclusions:
    """What the demo measures on: the datasets' and benchmark's pictures, and the user
    turns of every text conversation they hold (all rows, a superset of the held-out)."""
    return Exclusions(
        pictures={picture_key(spec) for spec in pictures},
        prompts={prompt_key(turns) for turns in conversations},
    )
