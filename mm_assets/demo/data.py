"""Deterministic synthetic chat datasets for the offline demo.

The real pipeline consumes ShareGPT4V (COCO images + long captions) and text-only ShareGPT
dumps. Neither can be downloaded here, so the demo draws small pictures of coloured shapes
(`images.py`) and writes captions that actually describe them, in the same file layouts. A
handful of records point at images that are deliberately absent, so the pipeline's handling of
broken references is exercised too.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mm_assets.demo import images
from mm_assets.demo.images import ImageSpec, Shape

__all__ = ["build_demo_datasets", "demo_corpus"]

IMAGES_SUBDIR = Path("coco") / "train2017"
SHAREGPT4V_FILE = Path("data") / "sharegpt4v_coco.json"
SHAREGPT_FILE = Path("data") / "sharegpt.jsonl"

# Strings the chat templates add around the dataset text; the demo tokenizer should know them.
TEMPLATE_STRINGS = ("system", "user", "assistant", "tool", "You are a helpful assistant.")

MAX_MISSING = 4
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

FIRST_PROMPTS: tuple[str, ...] = (
    "Describe the picture.",
    "What do you see in this image?",
    "Give a short description of the image.",
    "Analyze the image in a comprehensive and detailed manner.",
    "What is shown here?",
    "Can you describe the shapes and colours in this picture?",
    "Write a caption for this image.",
    "Tell me about this image.",
)
CLOSING_SENTENCES: tuple[str, ...] = (
    "Nothing else appears in the scene.",
    "There is no text in the image.",
    "The shapes are drawn with flat colours and no shading.",
    "The composition is simple and uncluttered.",
)


def _plural(n: int, word: str) -> str:
    """'one circle' / 'three circles' for counts spelled out in captions."""
    count = NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else str(n)
    return f"{count} {word}" if n == 1 else f"{count} {word}s"


def _join(items: Sequence[str]) -> str:
    """English list: 'a', 'a and b', 'a, b and c'."""
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def _a(word: str) -> str:
    """Indefinite article for the word that follows ('an orange', 'a red')."""
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _position(shape: Shape, width: int, height: int) -> str:
    """Coarse location of a shape's centre on a 3x3 grid, as a prepositional phrase."""
    x0, y0, x1, y1 = shape.box
    cx, cy = (x0 + x1) / 2 / width, (y0 + y1) / 2 / height
    vertical = "top" if cy < 1 / 3 else "bottom" if cy > 2 / 3 else ""
    horizontal = "left" if cx < 1 / 3 else "right" if cx > 2 / 3 else ""
    if vertical and horizontal:
        return f"in the {vertical} {horizontal} corner"
    if vertical:
        return f"near the {vertical}"
    if horizontal:
        return f"on the {horizontal} side"
    return "in the centre"


def _listing(shapes: Sequence[Shape]) -> str:
    """'two red circles and a blue square': identical shapes are counted, order is kept."""
    counts = Counter(f"{shape.colour} {shape.kind}" for shape in shapes)
    return _join([_a(name) if n == 1 else _plural(n, name) for name, n in counts.items()])


def _size_word(shape: Shape, width: int, height: int) -> str:
    """Relative size of a shape compared to the whole picture."""
    fraction = shape.area() / (width * height)
    return "large" if fraction > 0.12 else "small" if fraction < 0.03 else "medium-sized"


def _orientation(width: int, height: int) -> str:
    """Aspect-ratio description for captions."""
    if max(width, height) >= 6 * min(width, height):
        return "a very thin horizontal strip" if width > height else "a very thin vertical strip"
    if width > 1.25 * height:
        return "wider than it is tall"
    if height > 1.25 * width:
        return "taller than it is wide"
    return "roughly square"


def _describe(rng: random.Random, spec: ImageSpec) -> str:
    """A 1-4 sentence caption whose facts all follow from the spec."""
    listing = _listing(spec.shapes)
    n = len(spec.shapes)
    bg = spec.background
    overviews = (
        f"The image shows {listing} on {_a(bg)} background.",
        f"This picture contains {_plural(n, 'shape')} on a plain {bg} background: {listing}.",
        f"Against {_a(bg)} background, there {'is' if n == 1 else 'are'} {listing}.",
        f"A simple drawing of {listing} over {_a(bg)} backdrop.",
    )
    overview = rng.choice(overviews)
    extras: list[str] = []
    for shape in spec.shapes:
        where = _position(shape, spec.width, spec.height)
        size = _size_word(shape, spec.width, spec.height)
        phrasings = (
            f"The {shape.colour} {shape.kind} is {size} and sits {where}.",
            f"There is {_a(size)} {shape.colour} {shape.kind} {where}.",
            f"{_a(size).capitalize()} {shape.colour} {shape.kind} appears {where}.",
        )
        extras.append(rng.choice(phrasings))
    orientation = _orientation(spec.width, spec.height)
    phrasings = (
        f"The picture is {spec.width} pixels wide and {spec.height} pixels tall, "
        f"so it is {orientation}.",
        f"The whole image is {orientation}.",
    )
    extras.append(rng.choice(phrasings))
    extras.append(rng.choice(CLOSING_SENTENCES))
    n_extra = rng.randint(0, 3)
    return " ".join([overview, *rng.sample(extras, min(n_extra, len(extras)))])


def _follow_ups(rng: random.Random, spec: ImageSpec) -> list[tuple[str, str]]:
    """Question/answer pairs about the same picture for multi-turn records."""
    n = len(spec.shapes)
    biggest = max(spec.shapes, key=Shape.area)
    wide = spec.width > spec.height
    probe_colour, probe_kind = rng.choice(sorted(images.COLOURS)), rng.choice(images.SHAPES)
    present = any(s.colour == probe_colour and s.kind == probe_kind for s in spec.shapes)
    pairs = [
        ("What colour is the background?", f"The background is {spec.background}."),
        (
            "How many shapes are there?",
            f"There {'is' if n == 1 else 'are'} {_plural(n, 'shape')} in the picture.",
        ),
        (
            "Which shape is the biggest?",
            f"The biggest shape is the {biggest.colour} {biggest.kind}.",
        ),
        (
            "Is the image wider than it is tall?",
            f"{'Yes' if wide else 'No'}, it is {spec.width} pixels wide and "
            f"{spec.height} pixels tall.",
        ),
        (
            f"Is there {_a(probe_colour)} {probe_kind} in the picture?",
            f"Yes, there is {_a(probe_colour)} {probe_kind}."
            if present
            else f"No, there is no {probe_colour} {probe_kind} in this image.",
        ),
    ]
    return rng.sample(pairs, rng.randint(1, 2))


def _multimodal_records(rng: random.Random, specs: Sequence[ImageSpec]) -> list[dict[str, object]]:
    """ShareGPT4V records; about a third of them continue for one or two more exchanges."""
    records: list[dict[str, object]] = []
    for spec in specs:
        turns = [
            {"from": "human", "value": "<image>\n" + rng.choice(FIRST_PROMPTS)},
            {"from": "gpt", "value": _describe(rng, spec)},
        ]
        if rng.random() < 0.35:
            for question, answer in _follow_ups(rng, spec):
                turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        image = (IMAGES_SUBDIR / spec.filename).as_posix()
        records.append({"id": f"{spec.image_id:012d}", "image": image, "conversations": turns})
    return records


_MIXES: tuple[tuple[str, str, str], ...] = (
    ("red", "blue", "purple"),
    ("red", "yellow", "orange"),
    ("blue", "yellow", "green"),
    ("red", "white", "pink"),
    ("black", "white", "gray"),
    ("blue", "green", "cyan"),
)
_SIDES = {"triangle": 3, "square": 4, "rectangle": 4, "pentagon": 5, "hexagon": 6, "octagon": 8}
_WORDS: tuple[str, ...] = ("red", "yellow", "purple", "circle", "triangle", "hexagon", "orange")
_SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a patient maths tutor. Answer briefly.",
    "You are a friendly assistant who answers in one or two sentences.",
)


@dataclass(frozen=True)
class TextTask:
    """A templated question, its correct answer and what a right answer must name:
    `truth`, the last of the words `answers` matches in it (answers restate operands)."""

    question: str
    answer: str
    truth: str
    answers: str  # a regular expression of the words that may answer it
    chance: float  # a uniform guess among those answers


_NUMBER = r"-?\d+"


def _words(words: Sequence[str]) -> str:
    return "|".join(sorted(set(words)))


def text_task(rng: random.Random) -> TextTask:
    """One templated question with its correct answer (the `demo_sharegpt` tasks)."""
    topic = rng.randrange(5)
    if topic == 0:
        a, b, mixed = rng.choice(_MIXES)
        mixes = [m for _, _, m in _MIXES]
        return TextTask(
            f"What colour do you get when you mix {a} and {b}?",
            f"Mixing {a} and {b} gives {mixed}.",
            mixed,
            _words(mixes),
            1 / len(set(mixes)),
        )
    if topic == 1:
        shape = rng.choice(sorted(_SIDES))
        words = [NUMBER_WORDS[n] for n in _SIDES.values()]
        return TextTask(
            f"How many sides does a {shape} have?",
            f"A {shape} has {_plural(_SIDES[shape], 'side')}.",
            NUMBER_WORDS[_SIDES[shape]],
            _words(words),
            1 / len(set(words)),
        )
    if topic == 2:
        word = rng.choice(_WORDS)
        return TextTask(
            f"How many letters are in the word '{word}'?",
            f"The word '{word}' has {len(word)} letters.",
            str(len(word)),
            _NUMBER,
            1 / len({len(w) for w in _WORDS}),
        )
    if topic == 3:
        red, blue = rng.randint(1, 9), rng.randint(1, 9)
        return TextTask(
            f"I have {red} red balls and {blue} blue balls. How many balls do I have?",
            f"You have {red} + {blue} = {red + blue} balls in total.",
            str(red + blue),
            _NUMBER,
            1 / 17,  # sums 2..18
        )
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice("+-*")
    value, shown = {"+": (a + b, "plus"), "-": (a - b, "minus"), "*": (a * b, "times")}[op]
    spread = {"+": 195, "-": 195, "*": 9797}[op]  # how many values the operation can give
    return TextTask(
        rng.choice((f"What is {a} {op} {b}?", f"Compute {a} {shown} {b}.")),
        rng.choice((f"{a} {op} {b} = {value}.", f"The answer is {value}.")),
        str(value),
        _NUMBER,
        1 / spread,
    )


def _text_exchange(rng: random.Random) -> tuple[str, str]:
    """One templated question with its correct answer."""
    task = text_task(rng)
    return task.question, task.answer


def _text_records(rng: random.Random, n_text: int) -> list[dict[str, object]]:
    """Text-only ShareGPT records, some with a leading system turn, 1-3 exchanges each."""
    records: list[dict[str, object]] = []
    for i in range(n_text):
        turns: list[dict[str, str]] = []
        if rng.random() < 0.25:
            turns.append({"from": "system", "value": rng.choice(_SYSTEM_PROMPTS)})
        for _ in range(rng.choice((1, 1, 2, 3))):
            question, answer = _text_exchange(rng)
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        records.append({"id": f"sharegpt_{i:05d}", "conversations": turns})
    return records


def dataset_pictures(n_multimodal: int = 200, seed: int = 0) -> list[ImageSpec]:
    """The pictures `build_demo_datasets` draws with the same arguments (missing ones
    included): what the demo target's lessons must never show."""
    return images.image_specs(random.Random(seed), n_multimodal)


def build_demo_datasets(
    demo_dir: Path, *, n_multimodal: int = 200, n_text: int = 120, seed: int = 0
) -> dict[str, Path]:
    """Write the demo images and both datasets under demo_dir; same inputs, same bytes.

    Returns the paths written: ``image_root`` (what record ``image`` paths are relative to),
    ``images`` (the COCO folder), ``sharegpt4v_coco`` (JSON list) and ``sharegpt`` (JSONL).
    """
    demo_dir = Path(demo_dir)
    rng = random.Random(seed)
    specs = images.image_specs(rng, n_multimodal)
    n_missing = min(MAX_MISSING, n_multimodal // 10)
    candidates = range(min(len(images.FIXED_SIZES), n_multimodal), n_multimodal)
    missing = set(rng.sample(candidates, n_missing))
    images_dir = demo_dir / IMAGES_SUBDIR
    images.write_images([spec for i, spec in enumerate(specs) if i not in missing], images_dir)

    multimodal = _multimodal_records(rng, specs)
    text = _text_records(rng, n_text)

    sharegpt4v = demo_dir / SHAREGPT4V_FILE
    sharegpt = demo_dir / SHAREGPT_FILE
    sharegpt4v.parent.mkdir(parents=True, exist_ok=True)
    sharegpt4v.write_text(json.dumps(multimodal, indent=2, ensure_ascii=False) + "\n")
    sharegpt.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in text))
    return {
        "image_root": demo_dir,
        "images": images_dir,
        "sharegpt4v_coco": sharegpt4v,
        "sharegpt": sharegpt,
    }


def demo_corpus(demo_dir: Path) -> list[str]:
    """All texts of the demo datasets plus template strings, to train the demo tokenizer on."""
    demo_dir = Path(demo_dir)
    records = json.loads((demo_dir / SHAREGPT4V_FILE).read_text())
    lines = (demo_dir / SHAREGPT_FILE).read_text().splitlines()
    records += [json.loads(line) for line in lines if line.strip()]
    texts = [str(turn["value"]) for record in records for turn in record.get("conversations", [])]
    return [*TEMPLATE_STRINGS, *texts]
