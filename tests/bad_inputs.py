"""Bad-input dataset files (every kind of broken record beside good ones)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

from PIL import Image

from tests.conftest import BAD_DIR


def png_declaring(path: Path, width: int, height: int) -> None:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")
    )


def write_bad_inputs() -> dict[int, str | None]:
    """Records of every bad kind beside good ones; returns index -> expected reason."""
    images = BAD_DIR / "coco" / "train2017"
    images.mkdir(parents=True, exist_ok=True)
    Image.effect_noise((80, 60), 50).convert("RGB").save(images / "good.jpg", quality=95)
    Image.new("RGB", (50, 70), "green").save(images / "good2.png")
    (images / "empty.jpg").write_bytes(b"")
    full = (images / "good.jpg").read_bytes()
    (images / "cut.jpg").write_bytes(full[: len(full) // 2])
    (images / "text.jpg").write_text("not an image")
    png_declaring(images / "bomb.png", 50_000, 50_000)
    Image.new("RGB", (8, 8)).save(BAD_DIR / "outside.jpg")
    escape = images / "escape.jpg"
    if not escape.is_symlink():
        escape.symlink_to(BAD_DIR / "outside.jpg")

    def v4(image, *turns):
        return {"image": image, "conversations": [{"from": f, "value": v} for f, v in turns]}

    ask = ("human", "<image>\nWhat is it?")
    answer = ("gpt", "A picture.")
    cases: list[tuple[object, str | None]] = [
        (v4("coco/train2017/good.jpg", ask, answer), None),
        (v4("coco/train2017/good2.png", ask, answer, ("human", "More?"), ("gpt", "Green.")), None),
        (v4("coco/train2017/nope.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/empty.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/cut.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/text.jpg", ask, answer), "image_unavailable"),
        (v4("coco/../outside.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/escape.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/bomb.png", ask, answer), "image_unavailable"),
        (
            v4("coco/train2017/good.jpg", ("human", "<image>\n<image>\nTwo?"), answer),
            "image_placeholder_mismatch",
        ),
        (
            v4("coco/train2017/good.jpg", ("human", "No placeholder"), answer),
            "image_placeholder_mismatch",
        ),
        (v4(None, ("human", "Hello?")), "no_assistant_turn"),
        (v4(None), "empty_conversation"),
        ({"conversations": "human: hi / gpt: hello"}, "malformed_row"),
        (v4(None, ("narrator", "Once upon a time"), answer), "unknown_role"),
        (v4(None, ("human", "Just text?"), ("gpt", "Just text.")), None),
        (v4("coco/train2017/good.jpg", ask, answer), "duplicate_sample"),
        ([1, 2, 3], "malformed_row"),
    ]
    (BAD_DIR / "data.json").write_text(json.dumps([c for c, _ in cases]))
    return {i: reason for i, (_, reason) in enumerate(cases)}
