"""The demo's pictures: coloured shapes drawn with Pillow from specs the captions describe."""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

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
    x0, y0 = rng.randint(0, width - w), rng.randint(0, height - h)
    return Shape(kind=kind, colour=colour, box=(x0, y0, x0 + w - 1, y0 + h - 1))


def image_specs(rng: random.Random, n: int) -> list[ImageSpec]:
    """`n` random pictures with distinct COCO-like ids: a background, 1-4 shapes and a file
    format each; the first pictures get the fixed awkward sizes."""
    specs = []
    for i, image_id in enumerate(rng.sample(range(1, 581_930), n)):
        width, height = FIXED_SIZES[i] if i < len(FIXED_SIZES) else _random_size(rng)
        background = rng.choice(sorted(COLOURS))
        palette = [c for c in sorted(COLOURS) if c != background]
        n_shapes = rng.randint(1, 4)
        shapes = tuple(
            _random_shape(rng, width, height, rng.choice(palette)) for _ in range(n_shapes)
        )
        fmt = "PNG" if rng.random() < 0.3 else "JPEG"
        mode = "RGBA" if fmt == "PNG" and rng.random() < 0.5 else "RGB"
        specs.append(ImageSpec(image_id, width, height, fmt, mode, background, shapes))
    return specs


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


def encode(spec: ImageSpec) -> bytes:
    """The picture's file bytes, in its format (JPEG at quality 90)."""
    out = io.BytesIO()
    options = {"quality": 90} if spec.fmt == "JPEG" else {}
    _draw(spec).save(out, format=spec.fmt, **options)
    return out.getvalue()


def write_images(specs: list[ImageSpec], images_dir: Path) -> None:
    """Draw `specs` into `images_dir`, removing any other picture a previous build left
    there (one the records now reference as missing)."""
    images_dir.mkdir(parents=True, exist_ok=True)
    keep = {spec.filename for spec in specs}
    for stale in images_dir.iterdir():
        if stale.suffix in (".jpg", ".png") and stale.name not in keep:
            stale.unlink()
    for spec in specs:
        (images_dir / spec.filename).write_bytes(encode(spec))
