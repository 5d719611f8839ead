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


def write_bad_inputs() -> tuple[dict[int, str | None], dict[int, str]]:
    """Records of every bad kind beside good ones. Returns, by source index, the reason
    normalization quarantines each row with (None: kept), and the reason tokenization
    quarantines the rows normalization keeps but that supervise nothing worth learning."""
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
    Image.new("CMYK", (40, 30), (0, 128, 0, 0)).save(images / "cmyk.jpg")
    Image.new("L", (30, 40), 128).save(images / "gray.png")
    Image.new("RGBA", (36, 36), (255, 0, 0, 128)).save(images / "alpha.png")
    (images / "folder.jpg").mkdir(exist_ok=True)

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
        # image modes a processor converts: kept
        (v4("coco/train2017/cmyk.jpg", ("human", "<image>\nCMYK?"), answer), None),
        (v4("coco/train2017/gray.png", ("human", "<image>\nGray?"), answer), None),
        (v4("coco/train2017/alpha.png", ("human", "<image>\nAlpha?"), answer), None),
        # roles written differently, non-ASCII text: kept
        (v4(None, ("Human", "Ça va? 你好 👋"), ("GPT", "Très bien, 谢谢.")), None),
        # answers with nothing to learn
        (v4(None, ("human", "Say nothing."), ("gpt", "")), "empty_assistant_turn"),
        (v4(None, ("human", "Blank?"), ("gpt", " \n\t ")), "empty_assistant_turn"),
        (
            v4(None, ("human", "One?"), ("gpt", "One."), ("human", "Two?"), ("gpt", "")),
            "empty_assistant_turn",
        ),
        # images that are not there, or not files under the root
        (v4("/etc/hostname", ask, answer), "image_unavailable"),
        (v4("sam/images/sa_1.jpg", ask, answer), "image_unavailable"),
        (v4("http://example.com/a.jpg", ask, answer), "image_unavailable"),
        (v4("coco/train2017/folder.jpg", ask, answer), "image_unavailable"),
        (v4(12345, ask, answer), "image_unavailable"),
        # placeholders that do not match the images
        (v4(None, ("human", "<image>\nNo image?"), answer), "image_placeholder_mismatch"),
        (
            v4(["coco/train2017/good.jpg", "coco/train2017/good2.png"], ask, answer),
            "image_placeholder_mismatch",
        ),
        (
            v4("coco/train2017/good.jpg", ("human", "Look."), ("gpt", "<image>\nHere.")),
            "image_placeholder_mismatch",
        ),
        # shapes that are not a conversation
        ({"image": None, "conversations": None}, "malformed_row"),
        (
            {"conversations": [{"from": "human", "value": 42}, {"from": "gpt", "value": "x"}]},
            "malformed_row",
        ),
        ({"conversations": [None, {"from": "gpt", "value": "x"}]}, "malformed_row"),
        ("just a string", "malformed_row"),
        ({"conversations": [{"value": "who?"}, {"from": "gpt", "value": "x"}]}, "unknown_role"),
    ]
    # text, but nothing besides the end-of-turn marker (the tokenizer reads it as one)
    late = {len(cases): "too_few_supervised_tokens"}
    cases.append((v4(None, ("human", "End?"), ("gpt", "<|im_end|>")), None))
    (BAD_DIR / "data.json").write_text(json.dumps([c for c, _ in cases]))
    return {i: reason for i, (_, reason) in enumerate(cases)}, late
