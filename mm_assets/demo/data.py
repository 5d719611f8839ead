"""Deterministic synthetic chat datasets for the offline demo.

The real pipeline consumes ShareGPT4V (COCO images + long captions) and text-only ShareGPT
dumps. Neither can be downloaded here, so this module draws small pictures of coloured shapes
with Pillow and writes captions that actually describe them, in the same file layouts. A
handful of records point at images that are deliberately absent, so the pipeline's handling of
broken references is exercised too.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

__all__ = ["build_demo_datasets", "demo_corpus"]

IMAGES_SUBDIR = Path("coco") / "train2017"
SHAREGPT4V_FILE = Path("data") / "sharegpt4v_coco.json"
SHAREGPT_FILE = Path("data") / "sharegpt.jsonl"

# Strings the chat templates add around the dataset text; the demo tokenizer should know them.
TEMPLATE_STRINGS: tuple[str, ...] = (
    "system",
    "user",
    "assistant",
    "tool",
    "You are a helpful assistant.",
)

# fmt: off
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 40), "green": (40, 170, 60), "blue": (30, 70, 210),
    "yellow": (245, 215, 40), "orange": (245, 140, 20), "purple": (130, 50, 170),
    "pink": (245, 150, 190), "white": (250, 250, 250), "black": (15, 15, 15),
    "gray": (128, 128, 128), "brown": (120, 75, 35), "cyan": (40, 200, 220),
}
# fmt: on
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "rectangle", "diamond", "hexagon")

# (width, height) of the first images: extreme aspect ratios and the size limits.
FIXED_SIZES: tuple[tuple[int, int], ...] = ((33, 517), (600, 40), (517, 33), (40, 40), (640, 640))
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


@dataclass(frozen=True)
class Shape:
    """One filled shape; kept so captions can be derived from what was drawn."""

    kind: str
    colour: str
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 (inclusive)

    def area(self) -> int:
        """Bounding-box area, used to pick the biggest shape and its size word."""
        x0, y0, x1, y1 = self.box
        return (x1 - x0 + 1) * (y1 - y0 + 1)


@dataclass(frozen=True)
class ImageSpec:
    """Everything needed to draw one picture and to describe it."""

    image_id: int
    width: int
    height: int
    fmt: str  # "JPEG" or "PNG"
    mode: str  # "RGB" or "RGBA" (PNG only)
    background: str
    shapes: tuple[Shape, ...]

    @property
    def filename(self) -> str:
        """COCO-style zero-padded file name with the extension of the real format."""
        return f"{self.image_id:012d}.{'jpg' if self.fmt == 'JPEG' else 'png'}"


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
    counts: dict[tuple[str, str], int] = {}
    for shape in shapes:
        counts[shape.colour, shape.kind] = counts.get((shape.colour, shape.kind), 0) + 1
    return _join(
        [
            _a(f"{colour} {kind}") if n == 1 else _plural(n, f"{colour} {kind}")
            for (colour, kind), n in counts.items()
        ]
    )


def _size_word(shape: Shape, width: int, height: int) -> str:
    """Relative size of a shape compared to the whole picture."""
    fraction = shape.area() / (width * height)
    return "large" if fraction > 0.12 else "small" if fraction < 0.03 else "medium-sized"


def _orientation(width: int, height: int) -> str:
    """Aspect-ratio description used by captions and yes/no answers."""
    if max(width, height) >= 6 * min(width, height):
        return "a very thin horizontal strip" if width > height else "a very thin vertical strip"
    if width > 1.25 * height:
        return "wider than it is tall"
    if height > 1.25 * width:
        return "taller than it is wide"
    return "roughly square"


def _random_size(rng: random.Random) -> tuple[int, int]:
    """Mostly COCO-like 640-pixel pictures, plus small and irregular ones."""
    if rng.random() < 0.5:
        other = rng.randint(300, 640)
        return (640, other) if rng.random() < 0.7 else (other, 640)
    return rng.randint(40, 640), rng.randint(40, 640)


def _random_shape(rng: random.Random, width: int, height: int, colour: str) -> Shape:
    """A shape that fits inside the canvas, however thin the canvas is."""
    kind = rng.choice(SHAPES)
    short = min(width, height)
    side = rng.randint(max(4, short // 5), max(5, (short * 4) // 5))
    w, h = (side, max(3, side // 2)) if kind == "rectangle" else (side, side)
    w, h = min(w, width), min(h, height)
    x0 = rng.randint(0, width - w)
    y0 = rng.randint(0, height - h)
    return Shape(kind=kind, colour=colour, box=(x0, y0, x0 + w - 1, y0 + h - 1))


def _make_spec(rng: random.Random, image_id: int, size: tuple[int, int]) -> ImageSpec:
    """Random picture description: background, 1-4 shapes, file format."""
    width, height = size
    background = rng.choice(sorted(COLOURS))
    palette = [c for c in sorted(COLOURS) if c != background]
    n_shapes = rng.randint(1, 4)
    shapes = tuple(_random_shape(rng, width, height, rng.choice(palette)) for _ in range(n_shapes))
    fmt = "PNG" if rng.random() < 0.3 else "JPEG"
    mode = "RGBA" if fmt == "PNG" and rng.random() < 0.5 else "RGB"
    return ImageSpec(image_id, width, height, fmt, mode, background, shapes)


def _draw(spec: ImageSpec) -> Image.Image:
    """Render a spec with ImageDraw; shapes are opaque even on RGBA canvases."""
    alpha = (255,) if spec.mode == "RGBA" else ()
    image = Image.new(spec.mode, (spec.width, spec.height), COLOURS[spec.background] + alpha)
    draw = ImageDraw.Draw(image)
    for shape in spec.shapes:
        fill = COLOURS[shape.colour] + alpha
        x0, y0, x1, y1 = shape.box
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        if shape.kind == "circle":
            draw.ellipse(shape.box, fill=fill)
        elif shape.kind in ("square", "rectangle"):
            draw.rectangle(shape.box, fill=fill)
        elif shape.kind == "triangle":
            draw.polygon([(x0, y1), (cx, y0), (x1, y1)], fill=fill)
        elif shape.kind == "diamond":
            draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)
        else:
            radius = max(1.0, min(x1 - x0, y1 - y0) / 2)
            draw.regular_polygon((cx, cy, radius), 6, fill=fill)
    return image


def _describe(rng: random.Random, spec: ImageSpec) -> str:
    """A 1-4 sentence caption whose facts all follow from the spec."""
    listing = _listing(spec.shapes)
    n = len(spec.shapes)
    bg = spec.background
    overview = rng.choice(
        (
            f"The image shows {listing} on {_a(bg)} background.",
            f"This picture contains {_plural(n, 'shape')} on a plain {bg} background: {listing}.",
            f"Against {_a(bg)} background, there {'is' if n == 1 else 'are'} {listing}.",
            f"A simple drawing of {listing} over {_a(bg)} backdrop.",
        )
    )
    extras: list[str] = []
    for shape in spec.shapes:
        where = _position(shape, spec.width, spec.height)
        size = _size_word(shape, spec.width, spec.height)
        extras.append(
            rng.choice(
                (
                    f"The {shape.colour} {shape.kind} is {size} and sits {where}.",
                    f"There is {_a(size)} {shape.colour} {shape.kind} {where}.",
                    f"{_a(size).capitalize()} {shape.colour} {shape.kind} appears {where}.",
                )
            )
        )
    orientation = _orientation(spec.width, spec.height)
    extras.append(
        rng.choice(
            (
                f"The picture is {spec.width} pixels wide and {spec.height} pixels tall, "
                f"so it is {orientation}.",
                f"The whole image is {orientation}.",
            )
        )
    )
    extras.append(rng.choice(CLOSING_SENTENCES))
    n_extra = rng.randint(0, 3)
    return " ".join([overview, *rng.sample(extras, min(n_extra, len(extras)))])


def _follow_ups(rng: random.Random, spec: ImageSpec) -> list[tuple[str, str]]:
    """Question/answer pairs about the same picture for multi-turn records."""
    n = len(spec.shapes)
    biggest = max(spec.shapes, key=Shape.area)
    wide = spec.width > spec.height
    probe_colour, probe_kind = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
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
        records.append(
            {
                "id": f"{spec.image_id:012d}",
                "image": (IMAGES_SUBDIR / spec.filename).as_posix(),
                "conversations": turns,
            }
        )
    return records


_MIXES: tuple[tuple[str, str, str], ...] = (
    ("red", "blue", "purple"),
    ("red", "yellow", "orange"),
    ("blue", "yellow", "green"),
    ("red", "white", "pink"),
    ("black", "white", "gray"),
    ("blue", "green", "cyan"),
)
_SIDES: dict[str, int] = {
    "triangle": 3,
    "square": 4,
    "rectangle": 4,
    "pentagon": 5,
    "hexagon": 6,
    "octagon": 8,
}
_WORDS: tuple[str, ...] = ("red", "yellow", "purple", "circle", "triangle", "hexagon", "orange")
_SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a patient maths tutor. Answer briefly.",
    "You are a friendly assistant who answers in one or two sentences.",
)


def _text_exchange(rng: random.Random) -> tuple[str, str]:
    """One templated question with its correct answer."""
    topic = rng.randrange(5)
    if topic == 0:
        a, b, mixed = rng.choice(_MIXES)
        return (
            f"What colour do you get when you mix {a} and {b}?",
            f"Mixing {a} and {b} gives {mixed}.",
        )
    if topic == 1:
        shape = rng.choice(sorted(_SIDES))
        sides = _SIDES[shape]
        return (
            f"How many sides does a {shape} have?",
            f"A {shape} has {_plural(sides, 'side')}.",
        )
    if topic == 2:
        word = rng.choice(_WORDS)
        return (
            f"How many letters are in the word '{word}'?",
            f"The word '{word}' has {len(word)} letters.",
        )
    if topic == 3:
        red, blue = rng.randint(1, 9), rng.randint(1, 9)
        return (
            f"I have {red} red balls and {blue} blue balls. How many balls do I have?",
            f"You have {red} + {blue} = {red + blue} balls in total.",
        )
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice("+-*")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    shown = "times" if op == "*" else "plus" if op == "+" else "minus"
    return (
        rng.choice((f"What is {a} {op} {b}?", f"Compute {a} {shown} {b}.")),
        rng.choice((f"{a} {op} {b} = {value}.", f"The answer is {value}.")),
    )


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


def _image_specs(rng: random.Random, n_multimodal: int) -> list[ImageSpec]:
    """Distinct COCO-like ids; the first pictures get the fixed awkward sizes."""
    ids = rng.sample(range(1, 581_930), n_multimodal)
    specs = []
    for i, image_id in enumerate(ids):
        size = FIXED_SIZES[i] if i < len(FIXED_SIZES) else _random_size(rng)
        specs.append(_make_spec(rng, image_id, size))
    return specs


def build_demo_datasets(
    demo_dir: Path, *, n_multimodal: int = 200, n_text: int = 120, seed: int = 0
) -> dict[str, Path]:
    """Write the demo images and both datasets under demo_dir; same inputs, same bytes.

    Returns the paths written: ``image_root`` (what record ``image`` paths are relative to),
    ``images`` (the COCO folder), ``sharegpt4v_coco`` (JSON list) and ``sharegpt`` (JSONL).
    """
    demo_dir = Path(demo_dir)
    rng = random.Random(seed)
    specs = _image_specs(rng, n_multimodal)
    n_missing = min(MAX_MISSING, n_multimodal // 10)
    candidates = range(min(len(FIXED_SIZES), n_multimodal), n_multimodal)
    missing = set(rng.sample(candidates, n_missing))

    images_dir = demo_dir / IMAGES_SUBDIR
    images_dir.mkdir(parents=True, exist_ok=True)
    keep = {spec.filename for i, spec in enumerate(specs) if i not in missing}
    for stale in images_dir.iterdir():  # a previous build may have written a now-missing image
        if stale.suffix in (".jpg", ".png") and stale.name not in keep:
            stale.unlink()
    for i, spec in enumerate(specs):
        if i in missing:
            continue
        image = _draw(spec)
        target = images_dir / spec.filename
        if spec.fmt == "JPEG":
            image.save(target, format="JPEG", quality=90)
        else:
            image.save(target, format="PNG")

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


def _conversation_values(records: Iterable[dict[str, Any]]) -> Iterator[str]:
    """Every turn's text, in file order."""
    for record in records:
        for turn in record.get("conversations", []):
            yield str(turn["value"])


def demo_corpus(demo_dir: Path) -> list[str]:
    """All texts of the demo datasets plus template strings, to train the demo tokenizer on."""
    demo_dir = Path(demo_dir)
    multimodal = json.loads((demo_dir / SHAREGPT4V_FILE).read_text())
    lines = (demo_dir / SHAREGPT_FILE).read_text().splitlines()
    text = (json.loads(line) for line in lines if line.strip())
    return [
        *TEMPLATE_STRINGS,
        *_conversation_values(multimodal),
        *_conversation_values(text),
    ]
