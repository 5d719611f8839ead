"""Tiny multimodal targets with seeded random weights, built locally (the Hub is unreachable).

The demo needs a target model that transformers and vLLM load exactly like a real checkpoint:
a Qwen2.5-VL-shaped one (the main path, with assistant-mask markers in its chat template) and a
LLaVA-shaped one (fixed image token count, template without generation markers). Both share a
byte-level BPE tokenizer trained on the demo corpus, so sequences stay short and every demo
word is in the vocabulary. Everything is seeded, small and fast to write. The demo trains the
Qwen2.5-VL-shaped one from here (`target_training.py`); tests that only need shapes (ids,
masks, template quirks) use these random weights as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

VOCAB_SIZE = 2048
VOCAB_MULTIPLE = 64
MAX_POSITIONS = 4096
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHAT_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    *CHAT_SPECIAL_TOKENS,
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
LLAVA_IMAGE_TOKEN = "<image>"

# Shared by both targets: 64-wide, 8 layers, head_dim 32 (vLLM's CPU attention needs >= 32).
TEXT_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
}
HEAD_DIM = TEXT_DIMS["hidden_size"] // TEXT_DIMS["num_attention_heads"]

# ChatML without generation markers; each image part becomes one <image> placeholder.
LLAVA_CHAT_TEMPLATE = r"""{%- for message in messages -%}
    {{- '<|im_start|>' + message.role + '\n' -}}
    {%- if message.content is string -%}
        {{- message.content -}}
    {%- else -%}
        {%- for part in message.content -%}
            {%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}
                {{- '<image>' -}}
            {%- elif part.type == 'text' or 'text' in part -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


def _train_tokenizer(corpus: Iterable[str], special_tokens: Sequence[str]) -> Qwen2Tokenizer:
    """Byte-level BPE with Qwen2's normalizer and pre-tokenizer, specials appended at the end.

    The pipeline matches Qwen2Tokenizer exactly because transformers rebuilds that class from
    vocab + merges on load; any other pre-tokenizer would silently change on reload.
    """
    backend = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(special_tokens),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    backend.train_from_iterator(list(corpus), trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    # Qwen layout: special tokens follow the BPE vocabulary, in a fixed order.
    for offset, token in enumerate(special_tokens):
        vocab[token] = len(model["vocab"]) + offset
    named = {EOS_TOKEN, PAD_TOKEN}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(pair) for pair in model["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[t for t in special_tokens if t not in named],
        model_max_length=MAX_POSITIONS,
    )


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """Id of a special token, failing loudly rather than returning None/unk."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
        raise ValueError(f"{token!r} is not a single token of the demo tokenizer")
    return token_id


def _text_config(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """Text-tower settings common to both targets, with ids taken from the tokenizer."""
    return {
        **TEXT_DIMS,
        # embedding rows padded like real checkpoints, so vocab_size >= len(tokenizer)
        "vocab_size": -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        "bos_token_id": _token_id(tokenizer, PAD_TOKEN),
        "eos_token_id": _token_id(tokenizer, EOS_TOKEN),
        "pad_token_id": _token_id(tokenizer, PAD_TOKEN),
        "tie_word_embeddings": False,
    }


def random_model(
    model_cls: type[PreTrainedModel], config: PreTrainedConfig, vocab_in_use: int, seed: int
) -> PreTrainedModel:
    """A seeded float32 init whose embedding rows past the tokenizer's `vocab_in_use`
    (vocab padding) are zeroed, as in trained checkpoints: a zero logit never beats the
    best of hundreds of random ones, so greedy decoding cannot emit ids that the
    tokenizer would silently decode to nothing."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for embedding in (model.get_input_embeddings(), model.get_output_embeddings()):
            embedding.weight[vocab_in_use:].zero_()
    return model


def _save_random_model(
    model_cls: type[PreTrainedModel],
    config: PreTrainedConfig,
    tokenizer: PreTrainedTokenizerFast,
    out_dir: Path,
    seed: int,
) -> None:
    """`random_model` plus a greedy generation config that stops on <|im_end|>."""
    model = random_model(model_cls, config, len(tokenizer), seed)
    model.generation_config = GenerationConfig(
        bos_token_id=_token_id(tokenizer, PAD_TOKEN),
        eos_token_id=[_token_id(tokenizer, EOS_TOKEN), _token_id(tokenizer, PAD_TOKEN)],
        pad_token_id=_token_id(tokenizer, PAD_TOKEN),
        do_sample=False,
    )
    model.save_pretrained(out_dir)


def _rename_weight_prefix(out_dir: Path, old: str, new: str) -> None:
    """Rewrite saved weight names whose prefix transformers 5 changed on save.

    transformers 5.19 writes a LLaVA CLIP tower as ``vision_tower.embeddings...`` while Hub
    checkpoints (and vLLM's loader) use ``vision_tower.vision_model.embeddings...``;
    transformers itself loads either layout.
    """
    path = out_dir / "model.safetensors"  # single shard: the model is ~2 MB
    tensors = load_file(path)
    renamed = {
        (new + key.removeprefix(old) if key.startswith(old) and not key.startswith(new) else key): t
        for key, t in tensors.items()
    }
    save_file(renamed, path, metadata={"format": "pt"})


def build_demo_target(
    out_dir: Path,
    corpus: Iterable[str],
    *,
    min_pixels: int = 56 * 56,
    max_pixels: int = 224 * 224,
    seed: int = 0,
) -> Path:
    """Write a tiny Qwen2.5-VL checkpoint + processor to out_dir and return out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # the Qwen-style template shipped next to this module (package data)
    template = resources.files(__package__).joinpath("chat_template.jinja").read_text()
    tokenizer = _train_tokenizer(corpus, QWEN_SPECIAL_TOKENS)
    tokenizer.chat_template = template
    mrope_section = [HEAD_DIM // 8, 3 * HEAD_DIM // 16, 3 * HEAD_DIM // 16]  # [4, 6, 6]
    config = Qwen2_5_VLConfig(
        text_config={
            **_text_config(tokenizer),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": mrope_section,
            },
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "num_heads": 2,
            "intermediate_size": 128,
            "out_hidden_size": TEXT_DIMS["hidden_size"],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        },
        image_token_id=_token_id(tokenizer, "<|image_pad|>"),
        video_token_id=_token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=_token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=_token_id(tokenizer, "<|vision_end|>"),
        tie_word_embeddings=False,
        dtype="float32",
    )
    _save_random_model(Qwen2_5_VLForConditionalGeneration, config, tokenizer, out_dir, seed)
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels),
        chat_template=template,
    )
    processor.save_pretrained(out_dir)
    return out_dir


def build_llava_style_target(
    out_dir: Path, corpus: Iterable[str], *, image_size: int = 56, seed: int = 0
) -> Path:
    """Write a tiny LLaVA checkpoint + processor (fixed tokens per image) and return out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    patch_size = 14
    tokenizer = _train_tokenizer(corpus, (*CHAT_SPECIAL_TOKENS, LLAVA_IMAGE_TOKEN))
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    image_seq_length = (image_size // patch_size) ** 2  # CLS added, then dropped by "default"
    vision_config = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=64,
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=LlamaConfig(**_text_config(tokenizer), head_dim=HEAD_DIM),
        image_token_index=_token_id(tokenizer, LLAVA_IMAGE_TOKEN),
        image_seq_length=image_seq_length,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    _save_random_model(LlavaForConditionalGeneration, config, tokenizer, out_dir, seed)
    _rename_weight_prefix(out_dir, "vision_tower.", "vision_tower.vision_model.")
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        do_center_crop=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_CHAT_TEMPLATE,
        image_token=LLAVA_IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(out_dir)
    return out_dir
