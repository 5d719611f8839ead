"""Checks that the offline demo assets have the shape the pipeline relies on.

The datasets and targets replace Hub downloads, so these tests pin what downstream code
assumes: file layouts, deliberately missing images, loadable checkpoints, the assistant mask
of the Qwen-style template and the fixed image token count of the LLaVA-style processor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    ProcessorMixin,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
)

from mm_assets.demo.data import build_demo_datasets, demo_corpus
from mm_assets.demo.images import COLOURS
from mm_assets.demo.target import build_demo_target, build_llava_style_target

N_MULTIMODAL = 60
N_TEXT = 40
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One small dataset build shared by the module (building is deterministic)."""
    root = tmp_path_factory.mktemp("demo")
    return build_demo_datasets(root, n_multimodal=N_MULTIMODAL, n_text=N_TEXT, seed=0)


@pytest.fixture(scope="module")
def corpus(demo: dict[str, Path]) -> list[str]:
    """Texts the demo tokenizers are trained on."""
    return demo_corpus(demo["image_root"])


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    """The Qwen2.5-VL-style target, built once for the module."""
    return build_demo_target(tmp_path_factory.mktemp("qwen"), corpus)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    """The LLaVA-style target, built once for the module."""
    return build_llava_style_target(tmp_path_factory.mktemp("llava"), corpus)


def _multimodal(demo: dict[str, Path]) -> list[dict[str, Any]]:
    return json.loads(demo["sharegpt4v_coco"].read_text())


def _present_records(demo: dict[str, Path]) -> Iterator[dict[str, Any]]:
    """Multimodal records whose image exists on disk."""
    for record in _multimodal(demo):
        if (demo["image_root"] / record["image"]).is_file():
            yield record


def _as_messages(record: dict[str, Any], image: Image.Image) -> list[dict[str, Any]]:
    """ShareGPT4V turns as HF chat messages, the <image> line replaced by an image part."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    messages: list[dict[str, Any]] = []
    for i, turn in enumerate(record["conversations"]):
        content: list[dict[str, Any]] = []
        text = turn["value"]
        if i == 0:
            assert text.startswith("<image>\n")
            text = text.removeprefix("<image>\n")
            content.append({"type": "image", "image": image})
        content.append({"type": "text", "text": text})
        messages.append({"role": roles[turn["from"]], "content": content})
    return messages


def _masked_spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    """Maximal runs of token ids where the assistant mask is 1."""
    spans: list[list[int]] = []
    current: list[int] = []
    for token, flag in zip(ids, mask, strict=True):
        if flag:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


def test_multimodal_dataset_format(demo: dict[str, Path]) -> None:
    records = _multimodal(demo)
    assert len(records) == N_MULTIMODAL
    assert len({r["id"] for r in records}) == N_MULTIMODAL
    for record in records:
        assert set(record) == {"id", "image", "conversations"}
        assert record["image"].startswith("coco/train2017/")
        assert Path(record["image"]).stem == record["id"] and len(record["id"]) == 12
        turns = record["conversations"]
        assert len(turns) in (2, 4, 6)
        assert [t["from"] for t in turns] == ["human", "gpt"] * (len(turns) // 2)
        assert turns[0]["value"].split("\n")[0] == "<image>"
        assert all("<image>" not in t["value"] for t in turns[1:])
        assert 1 <= turns[1]["value"].count(".") <= 4  # 1-4 sentences
    assert any(len(r["conversations"]) > 2 for r in records)


def test_captions_describe_the_drawn_background(demo: dict[str, Path]) -> None:
    """Where a caption names the background colour, the image corner mostly has that colour."""
    considered = matches = 0
    for record in _present_records(demo):
        caption = record["conversations"][1]["value"]
        colour = next((c for c in COLOURS if f"{c} background" in caption), None)
        if colour is None:
            continue
        with Image.open(demo["image_root"] / record["image"]) as image:
            corner = image.convert("RGB").getpixel((0, 0))
        considered += 1
        # JPEG is lossy and a shape may cover the corner, so allow slack and a few misses.
        matches += all(abs(a - b) <= 16 for a, b in zip(corner, COLOURS[colour], strict=True))
    assert considered >= 5
    assert matches >= 0.6 * considered


def test_some_images_are_missing_on_purpose(demo: dict[str, Path]) -> None:
    records = _multimodal(demo)
    missing = [r for r in records if not (demo["image_root"] / r["image"]).exists()]
    assert len(missing) == 4
    on_disk = {p.name for p in demo["images"].iterdir()}
    assert len(on_disk) == N_MULTIMODAL - 4
    assert on_disk == {Path(r["image"]).name for r in records if r not in missing}


def test_images_vary_in_size_and_format(demo: dict[str, Path]) -> None:
    sizes: set[tuple[int, int]] = set()
    formats: set[str] = set()
    for path in demo["images"].iterdir():
        with Image.open(path) as image:
            sizes.add(image.size)
            formats.add(image.format or "")
            assert path.suffix == {"JPEG": ".jpg", "PNG": ".png"}[image.format or ""]
            assert 33 <= image.width <= 640 and 33 <= image.height <= 640
    assert formats == {"JPEG", "PNG"}
    assert {(33, 517), (600, 40)} <= sizes
    assert len(sizes) > N_MULTIMODAL // 2


def test_text_dataset_format(demo: dict[str, Path]) -> None:
    lines = demo["sharegpt"].read_text().splitlines()
    assert len(lines) == N_TEXT
    records = [json.loads(line) for line in lines]
    with_system = 0
    for record in records:
        assert set(record) == {"id", "conversations"}
        turns = record["conversations"]
        if turns[0]["from"] == "system":
            with_system += 1
            turns = turns[1:]
        assert turns and [t["from"] for t in turns] == ["human", "gpt"] * (len(turns) // 2)
        assert all(t["value"] and "<image>" not in t["value"] for t in turns)
    assert 0 < with_system < N_TEXT


def test_datasets_are_deterministic(demo: dict[str, Path], tmp_path: Path) -> None:
    again = build_demo_datasets(tmp_path, n_multimodal=N_MULTIMODAL, n_text=N_TEXT, seed=0)
    for key in ("sharegpt4v_coco", "sharegpt"):
        assert again[key].read_bytes() == demo[key].read_bytes()
    for path in demo["images"].iterdir():
        assert (again["images"] / path.name).read_bytes() == path.read_bytes()


def test_qwen_target_loads_and_runs_a_demo_sample(demo: dict[str, Path], qwen_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(qwen_dir)
    model = AutoModelForImageTextToText.from_pretrained(qwen_dir)
    assert isinstance(processor, Qwen2_5_VLProcessor) and isinstance(processor, ProcessorMixin)
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    assert model.dtype == torch.float32
    config = model.config
    tokenizer = processor.tokenizer
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert config.text_config.vocab_size % 64 == 0
    assert config.text_config.vocab_size >= len(tokenizer)

    record = next(_present_records(demo))
    with Image.open(demo["image_root"] / record["image"]) as image:
        messages = _as_messages(record, image.copy())
    inputs = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt"
    )
    n_image_tokens = int((inputs["input_ids"] == config.image_token_id).sum())
    assert n_image_tokens == int(inputs["image_grid_thw"].prod()) // 4 > 0
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_qwen_processor_accepts_image_paths_with_pil_backend(
    demo: dict[str, Path], qwen_dir: Path
) -> None:
    """Path inputs decoded by PIL give the same grid as a preloaded image.

    The default (torchvision) image backend cannot decode paths here: torchvision's compiled
    image ops do not load beside CPU torch, so path inputs go through the PIL backend.
    """
    default = AutoProcessor.from_pretrained(qwen_dir)
    with_pil = AutoProcessor.from_pretrained(
        qwen_dir, image_processor=Qwen2VLImageProcessorPil.from_pretrained(qwen_dir)
    )
    for record in list(_present_records(demo))[:3]:
        path = demo["image_root"] / record["image"]
        with Image.open(path) as image:
            preloaded = image.copy()
        by_path = with_pil.apply_chat_template(
            [{"role": "user", "content": [{"type": "image", "path": str(path)}]}],
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        by_image = default.apply_chat_template(
            [{"role": "user", "content": [{"type": "image", "image": preloaded}]}],
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        assert torch.equal(by_path["image_grid_thw"], by_image["image_grid_thw"])
        assert torch.equal(by_path["input_ids"], by_image["input_ids"])
        t, h, w = by_path["image_grid_thw"][0].tolist()
        assert t == 1 and 56 * 56 <= h * w * 14 * 14 <= 224 * 224


def test_chat_template_masks_exactly_assistant_content(qwen_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
    answers = ["2 + 3 = 5.", "Doubled, that is 10."]
    conversation = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": answers[0]},
        {"role": "user", "content": [{"type": "text", "text": "And doubled?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": answers[1]}]},
    ]
    out = tokenizer.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    rendered = tokenizer.decode(ids)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert rendered.endswith(f"{answers[1]}{IM_END}\n")
    expected = [tokenizer.encode(a + IM_END, add_special_tokens=False) for a in answers]
    assert _masked_spans(ids, mask) == expected
    assert sum(mask) == sum(len(e) for e in expected)


def test_processor_mask_skips_expanded_image_tokens(demo: dict[str, Path], qwen_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(qwen_dir)
    record = next(r for r in _present_records(demo) if len(r["conversations"]) > 2)
    with Image.open(demo["image_root"] / record["image"]) as image:
        messages = _as_messages(record, image.copy())
    out = processor.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        return_assistant_tokens_mask=True,
    )
    ids, mask = out["input_ids"][0].tolist(), out["assistant_masks"][0].tolist()
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(image_token_id) > 1  # the placeholder was expanded before masking
    answers = [t["value"] for t in record["conversations"] if t["from"] == "gpt"]
    tokenizer = processor.tokenizer
    expected = [tokenizer.encode(a + IM_END, add_special_tokens=False) for a in answers]
    assert _masked_spans(ids, mask) == expected


def test_generation_prompt_and_system_message(qwen_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
    system = {"role": "system", "content": "You are a concise assistant."}
    user = {"role": "user", "content": "Hi"}
    text = tokenizer.apply_chat_template([system, user], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tokenizer_special_tokens_are_atomic(qwen_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == "<|endoftext|>"
    for token in ("<|im_start|>", "<|vision_start|>", "<|image_pad|>", "<|video_pad|>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    text = "A red circle on a blue background."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_llava_weights_use_the_hub_key_layout(llava_dir: Path) -> None:
    """vLLM's LLaVA loader needs vision_tower.vision_model.*, which transformers 5 drops."""
    with safe_open(llava_dir / "model.safetensors", "pt") as weights:
        vision_keys = [k for k in weights.keys() if k.startswith("vision_tower.")]  # noqa: SIM118
    assert vision_keys
    assert all(k.startswith("vision_tower.vision_model.") for k in vision_keys)
    _, info = AutoModelForImageTextToText.from_pretrained(llava_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_llava_processor_expands_each_image_to_fixed_tokens(
    demo: dict[str, Path], llava_dir: Path
) -> None:
    processor = AutoProcessor.from_pretrained(llava_dir)
    model = AutoModelForImageTextToText.from_pretrained(llava_dir)
    image_id = model.config.image_token_index
    assert image_id == processor.tokenizer.convert_tokens_to_ids("<image>")
    assert model.config.image_seq_length == 16  # (56 / 14) ** 2 patches, CLS dropped

    images: list[Image.Image] = []
    for record in list(_present_records(demo))[:4]:
        with Image.open(demo["image_root"] / record["image"]) as image:
            images.append(image.copy())
    assert len({im.size for im in images}) > 1

    def n_image_tokens(parts: list[Image.Image]) -> tuple[int, dict[str, Any]]:
        content = [{"type": "image", "image": im} for im in parts]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": "Hi"}]}]
        inputs = processor.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_tensors="pt"
        )
        return int((inputs["input_ids"] == image_id).sum()), inputs

    assert [n_image_tokens([im])[0] for im in images] == [16] * len(images)
    count, inputs = n_image_tokens(images[:2])
    assert count == 32
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()


@pytest.mark.parametrize("verbose", [False, True])
def test_the_demo_console_shows_dagsters_step_events_only_when_verbose(
    demo_dir: Path, verbose: bool, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    """`make demo` leaves Dagster's per-step events to the run's history; `--verbose`
    prints them too (the run config the demo gives each job)."""
    import dagster as dg

    from mm_assets.definitions import defs
    from mm_assets.demo import __main__ as demo

    seen: dict[str, Any] = {}
    monkeypatch.setattr(demo, "run", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr("sys.argv", ["demo", "run", *(["--verbose"] if verbose else [])])
    demo.main()
    assert seen == {"verbose": verbose}
    logs = demo.VERBOSE if verbose else demo.QUIET
    result = defs.resolve_job_def("prepare").execute_in_process(
        partition_key=demo.DEMO_BENCHMARK, instance=dg.DagsterInstance.get(), run_config=logs
    )
    assert result.success
    printed = capfd.readouterr().err
    assert ("- DEBUG - prepare -" in printed) == verbose
    assert ('STEP_SUCCESS - Finished execution of step "raw_dataset"' in printed) == verbose
