"""The demo's benchmark: 40 prompts in each of four categories, none seen in training.

`make demo` measures the first 3 of each (`max_prompts_per_category` in the registry);
`make bench-quality` all of them, where a 95% interval is narrow enough to tell drafts
apart.

Shaped like the vision-language sets on the hub, so `make demo` loads that shape: TRL's
conversational layout (`messages` whose content parts are `{"type": "text"}` and
`{"type": "image"}`, matched in order to an `images` column) with the pictures *inside*
the Parquet file as the `datasets.Image` feature (bytes), written by the `datasets`
library itself. One category asks a second turn after the target's own first answer,
as MT-Bench does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from mm_assets.demo import images
from mm_assets.demo.data import _MIXES, _SIDES, SHAREGPT_FILE, _a, _plural
from mm_assets.demo.images import ImageSpec

BENCHMARK_FILE = Path("data") / "benchmark.parquet"
PER_CATEGORY = 40

_DESCRIBE = (
    "Please describe this picture in detail.",
    "What does this drawing show?",
    "List the shapes you can see and where they are.",
)
_FOLLOW_UP = (
    ("Which colours appear in the image?", "Which of them covers the largest area?"),
    ("How many shapes are drawn here?", "Describe the smallest one."),
    ("What is the background colour?", "Would a white shape stand out against it?"),
)


def _text_prompt(rng: random.Random, category: str) -> str:
    if category == "arithmetic":
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 9)
        return rng.choice(
            (
                f"What is ({a} + {b}) times {c}? Show the steps.",
                f"Subtract {b} from {a} and multiply the result by {c}.",
            )
        )
    shape = rng.choice(sorted(_SIDES))
    a, b, mixed = rng.choice(_MIXES)
    return rng.choice(
        (
            f"Draw me {_a(shape)} in words: how many corners and sides does it have?",
            f"If I paint {_a(shape)} with {a} and {b} mixed, what colour is it?",
            f"Spell the word '{mixed}' backwards and say how many letters it has.",
            f"Name a shape with more sides than {_a(shape)} ({_plural(_SIDES[shape], 'side')}).",
        )
    )


def _user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


IMAGE_PART = {"type": "image", "text": None}  # TRL's part: the image is in `images`


def benchmark_rows(per_category: int, seed: int, training_prompts: set[str]) -> list[dict]:
    """`per_category` rows of each category, none of whose text prompts is one the
    training data asks (`training_prompts`), with new pictures."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    pictures = iter(images.image_specs(rng, 2 * per_category))
    for _ in range(per_category):
        spec = next(pictures)
        rows.append(
            {
                "messages": [_user(IMAGE_PART, _text(rng.choice(_DESCRIBE)))],
                "images": [{"bytes": images.encode(spec), "path": None}],
                "category": "describe_image",
            }
        )
        spec, (first, second) = next(pictures), rng.choice(_FOLLOW_UP)
        rows.append(
            {
                "messages": [_user(IMAGE_PART, _text(first)), _user(_text(second))],
                "images": [{"bytes": images.encode(spec), "path": None}],
                "category": "image_follow_up",
            }
        )
    for category in ("arithmetic", "shapes_and_words"):
        asked: set[str] = set()
        while len(asked) < per_category:
            prompt = _text_prompt(rng, category)
            if prompt in training_prompts or prompt in asked:
                continue
            asked.add(prompt)
            rows.append({"messages": [_user(_text(prompt))], "images": [], "category": category})
    return rows


def benchmark_pictures(per_category: int = PER_CATEGORY, seed: int = 7) -> list[ImageSpec]:
    """The pictures `benchmark_rows` shows with the same arguments."""
    return images.image_specs(random.Random(seed), 2 * per_category)


def build_demo_benchmark(demo_dir: Path, per_category: int = PER_CATEGORY, seed: int = 7) -> Path:
    """Write the benchmark as Parquet with the hub's feature types; returns its path."""
    import datasets  # heavy import, only when building

    training = set()
    for line in (demo_dir / SHAREGPT_FILE).read_text().splitlines():
        for turn in json.loads(line)["conversations"] if line.strip() else []:
            training.add(turn["value"])
    features = datasets.Features(
        {
            "messages": datasets.List(
                {
                    "role": datasets.Value("string"),
                    "content": datasets.List(
                        {"type": datasets.Value("string"), "text": datasets.Value("string")}
                    ),
                }
            ),
            "images": datasets.List(datasets.Image()),
            "category": datasets.Value("string"),
        }
    )
    rows = benchmark_rows(per_category, seed, training)
    dataset = datasets.Dataset.from_list(rows, features=features)
    path = demo_dir / BENCHMARK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.disable_progress_bars()
    dataset.to_parquet(str(path))
    return path
