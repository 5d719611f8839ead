"""Capacity of a real run, computed: disk and GPU-hours of a 50k-sample ShareGPT4V run for
a Qwen2.5-VL-7B target, from the project's own formulas and stated inputs.

What is computed, and from what:
- image tokens per COCO image: the Qwen2.5-VL image processor's own resize rule
  (`smart_resize`, factor 28, its default pixel limits) on COCO's typical 640x480;
- bytes per sample on disk: `StorageFormat.estimate_bytes` (the disk budget's formula,
  the same as the extraction step's check) at the target's width, for each format;
- GPU-seconds: floating-point work over a stated share of the GPU's peak (model FLOPs
  utilisation, MFU) for prefill-like work (extraction, training), and weight bytes over
  memory bandwidth per decode step for regeneration. The model sizes are counted from the
  public Qwen2.5-VL-7B config; the MFU and batch figures are inputs, printed with the
  table, not measurements: none of this ran on a GPU here.

`.venv/bin/python -m bench.capacity` prints the Markdown table for docs/capacity.md.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mm_assets.domain.model.hidden_state_format import FinalLayer, StorageDtype, StorageFormat


@dataclass(frozen=True)
class Target:
    """The language model's shape (Qwen2.5-VL-7B-Instruct's public config.json)."""

    hidden_size: int = 3584
    layers: int = 28
    intermediate_size: int = 18944
    heads: int = 28
    kv_heads: int = 4
    vocab: int = 152064
    vision_params: float = 0.67e9  # the ViT + merger, from the checkpoint's tensor sizes

    def decoder_layer_params(self) -> int:
        head_dim = self.hidden_size // self.heads
        attention = 2 * self.hidden_size**2 + 2 * self.hidden_size * self.kv_heads * head_dim
        return attention + 3 * self.hidden_size * self.intermediate_size

    def language_params(self) -> int:
        embeddings = 2 * self.vocab * self.hidden_size  # input embeddings + untied lm_head
        return self.layers * self.decoder_layer_params() + embeddings


@dataclass(frozen=True)
class Inputs:
    samples: int = 50_000
    image_height: int = 480
    image_width: int = 640
    prompt_tokens: int = 60  # template, system prompt and question around the image
    reply_tokens: int = 250  # a detailed caption; regenerated with max_tokens 256
    draft_vocab: int = 32_000
    ttt_steps: int = 3
    epochs: int = 10
    gpu: str = "H100 SXM"
    peak_flops: float = 989e12  # dense bf16
    memory_bandwidth: float = 3.35e12  # bytes/s
    prefill_mfu: float = 0.4  # input: a share of peak for long prefills
    training_mfu: float = 0.3  # input: a small model's share of peak
    decode_batch: int = 128  # input: sequences decoded together per server


def image_tokens(height: int, width: int) -> int:
    """Tokens the Qwen2.5-VL processor gives one image (its resize rule, 2x2 merge)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 16384)
    return (h // 14) * (w // 14) // 4


def draft_params(target: Target, draft_vocab: int) -> int:
    """EAGLE-3 draft: fc over three layers, one decoder layer whose attention reads
    [embedding; hidden] (2H wide), and an lm_head over the draft vocabulary."""
    h = target.hidden_size
    head_dim = h // target.heads
    attention = 2 * h * h + 2 * (2 * h) * target.kv_heads * head_dim + h * h
    return 3 * h * h + attention + 3 * h * target.intermediate_size + draft_vocab * h


def capacity(target: Target, inputs: Inputs) -> list[tuple[str, str]]:
    image = image_tokens(inputs.image_height, inputs.image_width)
    tokens = image + inputs.prompt_tokens + inputs.reply_tokens
    all_tokens = inputs.samples * tokens
    supervised = inputs.samples * inputs.reply_tokens
    rows = [
        ("image tokens per 640x480 COCO image (Qwen2.5-VL resize rule)", f"{image}"),
        ("tokens per sample (image + prompt + reply)", f"{tokens:,}"),
        ("tokens in the run", f"{all_tokens / 1e6:,.1f} M ({supervised / 1e6:,.1f} M supervised)"),
    ]
    for name, fmt in (
        ("bf16, all positions (speculators' layout)", StorageFormat(StorageDtype.BF16)),
        ("fp8_e4m3, all positions", StorageFormat(StorageDtype.FP8_E4M3)),
        ("fp8_e4m3 / needed", StorageFormat(StorageDtype.FP8_E4M3, FinalLayer.NEEDED)),
    ):
        per_sample = fmt.estimate_bytes(
            tokens, inputs.reply_tokens, target.hidden_size, "bfloat16", 1
        )
        rows.append(
            (f"disk, {name}", f"{per_sample / 1e6:.1f} MB/sample, "
             f"{per_sample * inputs.samples / 1e9:,.0f} GB in all")
        )  # fmt: skip
    llm = target.language_params()
    prefill_flops = 2 * (llm + target.vision_params) * all_tokens
    prefill_s = prefill_flops / (inputs.peak_flops * inputs.prefill_mfu)
    weight_bytes = 2 * (llm + target.vision_params)
    decode_steps = inputs.samples * inputs.reply_tokens / inputs.decode_batch
    decode_s = decode_steps * weight_bytes / inputs.memory_bandwidth + prefill_s
    draft = draft_params(target, inputs.draft_vocab)
    train_flops = 6 * draft * all_tokens * inputs.ttt_steps * inputs.epochs
    train_s = train_flops / (inputs.peak_flops * inputs.training_mfu)
    target_params = (llm + target.vision_params) / 1e9
    rows += [
        ("target parameters (language model + vision)", f"{target_params:.2f} B"),
        ("draft parameters (EAGLE-3, one layer)", f"{draft / 1e9:.2f} B"),
        (f"GPU-hours, hidden states (prefill at {inputs.prefill_mfu:.0%} MFU)",
         f"{prefill_s / 3600:.2f}"),
        (f"GPU-hours, regeneration (batch {inputs.decode_batch}, bandwidth-bound)",
         f"{decode_s / 3600:.2f}"),
        (f"GPU-hours, training ({inputs.epochs} epochs x {inputs.ttt_steps} TTT steps, "
         f"{inputs.training_mfu:.0%} MFU)", f"{train_s / 3600:.2f}"),
    ]  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=Inputs.samples)
    args = parser.parse_args()
    inputs = Inputs(samples=args.samples)
    gpu = (
        f"{inputs.gpu} ({inputs.peak_flops / 1e12:.0f} TFLOP/s bf16, "
        f"{inputs.memory_bandwidth / 1e12:.2f} TB/s)"
    )
    print(f"Qwen2.5-VL-7B target, {inputs.samples:,} ShareGPT4V samples, one {gpu}\n")
    print("| quantity | value |\n|---|---:|")
    for name, value in capacity(Target(), inputs):
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
