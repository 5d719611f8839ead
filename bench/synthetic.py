"""Synthetic ShareGPT4V data for benchmarks: generated ~448² JPEGs and conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]


def make_images(root: Path, count: int, seed: int = 0, base: int = 448) -> list[str]:
    """`count` JPEGs around base×base (±15%), returned as `coco/train2017/…` references."""
    rng = random.Random(seed)
    out_dir = root / "train2017"
    out_dir.mkdir(parents=True, exist_ok=True)
    refs = []
    for i in range(count):
        w = int(base * rng.uniform(0.85, 1.15))
        h = int(base * rng.uniform(0.85, 1.15))
        name = f"{i:012d}.jpg"
        path = out_dir / name
        if not path.exists():
            image = Image.new("RGB", (w, h), rng.choice(COLOURS))
            draw = ImageDraw.Draw(image)
            for _ in range(3):
                x, y = rng.randrange(w - 20), rng.randrange(h - 20)
                draw.rectangle(
                    [x, y, x + rng.randrange(10, w // 2), y + rng.randrange(10, h // 2)],
                    fill=rng.choice(COLOURS),
                )
            image.save(path, quality=85)
        refs.append(f"coco/train2017/{name}")
    return refs


def make_records(refs: list[str], count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(count):
        colour = rng.choice(COLOURS)
        turns = [
            {"from": "human", "value": "<image>\nDescribe the picture in detail."},
            {
                "from": "gpt",
                "value": f"The picture shows {colour} shapes on a plain background. "
                * rng.randint(1, 4),
            },
        ]
        if rng.random() < 0.3:
            turns += [
                {"from": "human", "value": "Which colour stands out?"},
                {"from": "gpt", "value": f"The {colour} one stands out."},
            ]
        records.append({"id": f"bench-{i}", "image": refs[i % len(refs)], "conversations": turns})
    return records


def write_dataset(
    root: Path, count: int, distinct_images: int | None = None, seed: int = 0
) -> Path:
    refs = make_images(root / "coco", distinct_images or count, seed)
    path = root / f"sharegpt4v_{count}.json"
    path.write_text(json.dumps(make_records(refs, count, seed)))
    return path
