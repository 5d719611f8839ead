"""A tiny Qwen3-VL-architecture target (random weights) on the demo's tokenizer and
template: the position rule and the draft checkpoints are checked against the
architecture real deployments serve, not only the demo's Qwen2.5-VL class. Built here,
beside the tests, so the demo's own target (and its cache key) stays as it is."""

from __future__ import annotations

from pathlib import Path

from transformers import (
    AutoTokenizer,
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from mm_assets.demo.target import HEAD_DIM, QWEN_SPECIAL_TOKENS, TEXT_DIMS, random_model

PATCH = 16  # Qwen3-VL's patch side (Qwen2.5-VL's is 14)


def write_qwen3_vl_target(demo_target: Path, out_dir: Path) -> Path:
    """The demo target's tokenizer and chat template on a Qwen3-VL model: interleaved
    M-RoPE as Qwen3-VL checkpoints declare it, a one-block vision tower with deepstack."""
    tokenizer = AutoTokenizer.from_pretrained(demo_target)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    vocab = -(-len(tokenizer) // 64) * 64
    text = {
        **TEXT_DIMS,
        "head_dim": HEAD_DIM,
        "vocab_size": vocab,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [HEAD_DIM // 8, 3 * HEAD_DIM // 16, 3 * HEAD_DIM // 16],
            "mrope_interleaved": True,
        },
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision = {
        "depth": 1,
        "hidden_size": 64,
        "num_heads": 2,
        "intermediate_size": 128,
        "out_hidden_size": TEXT_DIMS["hidden_size"],
        "patch_size": PATCH,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    random_model(Qwen3VLForConditionalGeneration, config, len(tokenizer), seed=0).save_pretrained(
        out_dir
    )
    pixels = {"min_pixels": 64 * 64, "max_pixels": 256 * 256}
    Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=PATCH, merge_size=2, **pixels),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(patch_size=PATCH, merge_size=2),
        chat_template=tokenizer.chat_template,
    ).save_pretrained(out_dir)
    return out_dir
