"""Tokenization throughput: lazy (header sizes) vs the processor decoding pixels.

Same samples, same processor, one run; the processor uses Qwen2.5-VL's real image limits
(min_pixels 3136, max_pixels 12845056), so a ~448² image expands to a few hundred tokens.
Ids and masks of the two paths are compared on every sample.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from transformers import AutoProcessor

from bench.synthetic import write_dataset
from mm_assets.demo.target import build_demo_target
from mm_assets.domain.ingest.images import probe_reference
from mm_assets.domain.prep.conversations import image_references, normalize
from mm_assets.domain.prep.tokenization import ChatTokenizer
from tests.pixel_reference import tokenize_with_pixels

QWEN25_VL_MIN_PIXELS = 3136
QWEN25_VL_MAX_PIXELS = 12845056


def run(samples: int, workdir: Path) -> dict:
    data = write_dataset(workdir, samples)
    records = json.loads(data.read_text())
    corpus = [t["value"] for r in records for t in r["conversations"]]
    target = build_demo_target(
        workdir / "target", corpus, min_pixels=QWEN25_VL_MIN_PIXELS, max_pixels=QWEN25_VL_MAX_PIXELS
    )
    processor = AutoProcessor.from_pretrained(target)
    root = workdir / "coco"

    started = time.perf_counter()
    conversations = []
    for record in records:  # what the availability + normalization stages hand over
        probes = {
            r: probe_reference(root, r, "coco/") for r in image_references(record, "sharegpt4v")
        }
        conv = normalize(record, "sharegpt4v", probes)
        conversations.append((conv.turns, [(p.height, p.width) for p in conv.images]))
    probe_seconds = time.perf_counter() - started

    chat = ChatTokenizer(processor, max_length=1_000_000)
    started = time.perf_counter()
    lazy = [chat.tokenize(turns, sizes)[0] for turns, sizes in conversations]
    lazy_seconds = time.perf_counter() - started

    started = time.perf_counter()
    eager = [tokenize_with_pixels(processor, turns) for turns, _ in conversations]
    eager_seconds = time.perf_counter() - started

    identical = sum(
        a.input_ids == b["input_ids"] and a.loss_mask == b["loss_mask"]
        for a, b in zip(lazy, eager, strict=True)
    )
    image_tokens = sum(r.input_ids.count(chat.image_token_id) for r in lazy)
    tokens = sum(len(r.input_ids) for r in lazy)
    return {
        "samples": samples,
        "tokens": tokens,
        "image_tokens_per_sample": image_tokens / samples,
        "lazy_samples_per_s": samples / lazy_seconds,
        "lazy_with_header_probe_samples_per_s": samples / (lazy_seconds + probe_seconds),
        "pixels_samples_per_s": samples / eager_seconds,
        "speedup": eager_seconds / lazy_seconds,
        "speedup_including_header_probe": eager_seconds / (lazy_seconds + probe_seconds),
        "identical_rows": identical,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(args.samples, Path(tmp)), indent=2))


if __name__ == "__main__":
    main()
