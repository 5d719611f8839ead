"""Teach the demo target to answer: a short CPU training run on the generator's lessons.

A random-weight target answers in loops, and on loops vLLM's n-gram lookup beats any
draft and no training change can be judged. The demo's generator knows the truth of
every picture and text task (`lessons.py`), so a few minutes of supervised training
turn the Qwen2.5-VL-shaped target into one that answers in sentences that depend on the
picture. The run is seeded and single-process; `report` checks the answers on held-out
pictures and questions against chance.

It runs in a child process with its kernels pinned (`PINNED_KERNELS`): PyTorch, MKL and
oneDNN otherwise take the widest instructions the CPU has, each sums in its own order,
and two machines train two targets. Pinned, every x86-64 CPU with AVX2 trains the same.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from mm_assets.common.progress import Progress
from mm_assets.demo import images
from mm_assets.demo.lessons import Check, Exclusions, Lesson, as_messages

log = logging.getLogger(__name__)

REPORT_FILE = "answers_report.json"
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@dataclass(frozen=True)
class TeachingSettings:
    """How the demo target is trained; part of the build's cache key."""

    lessons: int = 19200
    batch_size: int = 16
    learning_rate: float = 5e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = 2  # fixed: a different thread count sums in another order
    check_pictures: int = 80
    check_text: int = 60
    max_new_tokens: int = 32
    max_pixels: int = 140 * 140  # the processor's limit: at most 25 tokens per picture
    picture_share: float = 0.7


def _picture(spec: images.ImageSpec | None) -> Image.Image | None:
    """The picture as the datasets store it, re-read so JPEG's losses are the same."""
    if spec is None:
        return None
    return Image.open(io.BytesIO(images.encode(spec))).convert("RGB")


def _length(lesson: Lesson) -> int:
    """A lesson's size in characters, with a picture counted as a fixed block."""
    return sum(len(text) for _, text in lesson.turns) + (200 if lesson.picture else 0)


def _batches(lessons: Sequence[Lesson], size: int, seed: int) -> list[list[Lesson]]:
    """Batches of lessons of similar length (less padding), in a seeded random order:
    lessons are sorted by length within windows of 16 batches."""
    rng = random.Random(seed)
    order = list(range(len(lessons)))
    rng.shuffle(order)
    window = 16 * size
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: _length(lessons[i]))
        batches += [chunk[i : i + size] for i in range(0, len(chunk) - size + 1, size)]
    rng.shuffle(batches)
    return [[lessons[i] for i in batch] for batch in batches]


def _encode(processor: Any, batch: Sequence[Lesson | Check], for_training: bool) -> Any:
    """Token ids, pixels and (for training) labels on the assistant tokens only, from the
    template's generation markers."""
    conversations = [as_messages(item, _picture(item.picture)) for item in batch]
    encoded = processor.apply_chat_template(
        conversations,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"padding": True},
        add_generation_prompt=not for_training,
        return_assistant_tokens_mask=for_training,
    )
    if for_training:
        mask = torch.as_tensor(encoded.pop("assistant_masks")).bool()
        encoded["labels"] = torch.where(mask, encoded["input_ids"], -100)
    return encoded


def _rate(step: int, total: int, settings: TeachingSettings) -> float:
    """Linear warmup, then cosine down to `min_lr_ratio` of the rate."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, total - settings.warmup_steps)
    floor = settings.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _patches_as_matmul(model: Qwen2_5_VLForConditionalGeneration) -> None:
    """Embed picture patches with one matrix product instead of the checkpoint's Conv3d
    (its kernel equals its stride, so the two compute the same): the same weights, a
    tenth of a training step less on the CPU. Only the instance is changed; the saved
    checkpoint is the model's own."""
    embed = model.model.visual.patch_embed
    weight = embed.proj.weight

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
        return flat @ weight.reshape(len(weight), -1).T

    embed.forward = forward


def _supervised_loss(model: Qwen2_5_VLForConditionalGeneration, encoded: Any) -> torch.Tensor:
    """Next-token cross-entropy on the assistant tokens, with the vocabulary projection
    computed only where a label is (most positions are picture and prompt)."""
    labels = encoded.pop("labels")[:, 1:]
    hidden = model.model(**encoded).last_hidden_state[:, :-1]
    supervised = labels != -100
    logits = model.lm_head(hidden[supervised])
    return torch.nn.functional.cross_entropy(logits, labels[supervised])


def teach(
    target_dir: Path,
    lessons: Sequence[Lesson],
    settings: TeachingSettings,
    say: Callable[[str], None] = log.info,
) -> list[float]:
    """Train the checkpoint in `target_dir` on `lessons` in place; the loss per step.
    `say` gets a progress line every 20 s."""
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    processor = AutoProcessor.from_pretrained(target_dir)
    processor.tokenizer.padding_side = "right"
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(target_dir, dtype=torch.float32)
    model.train()
    _patches_as_matmul(model)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=settings.learning_rate,
        betas=(0.9, 0.95),
        weight_decay=settings.weight_decay,
    )
    batches = _batches(lessons, settings.batch_size, settings.seed)
    total = len(batches)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _rate(step, total, settings)
    )
    losses: list[float] = []
    progress = Progress(say, "training the target: steps", total, every_s=20.0)
    for step, batch in enumerate(batches):
        loss = _supervised_loss(model, _encode(processor, batch, for_training=True))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        progress.update(step + 1, f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    model.save_pretrained(target_dir)
    return losses


def greedy_answers(
    target_dir: Path, asked: Sequence[Check], max_new_tokens: int, batch_size: int = 16
) -> list[str]:
    """The target's greedy answer to each check, from transformers."""
    processor = AutoProcessor.from_pretrained(target_dir)
    processor.tokenizer.padding_side = "left"
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(target_dir, dtype=torch.float32)
    model.eval()
    answers: list[str] = []
    for start in range(0, len(asked), batch_size):
        encoded = _encode(processor, asked[start : start + batch_size], for_training=False)
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False)
        new = out[:, encoded["input_ids"].shape[1] :]
        answers += processor.batch_decode(new, skip_special_tokens=True)
    return answers


@dataclass(frozen=True)
class AnswerScore:
    """How often the target's greedy answer is right, for one kind of check."""

    kind: str
    asked: int
    right: int
    chance: float

    @property
    def accuracy(self) -> float:
        return self.right / self.asked if self.asked else 0.0


def score(asked: Sequence[Check], answers: Sequence[str]) -> list[AnswerScore]:
    """Accuracy per kind of check, beside the chance of a uniform guess."""
    order = ["background", "count", "shape_colour", "text"]
    kinds = sorted({c.kind for c in asked}, key=order.index)
    scores = []
    for kind in kinds:
        pairs = [(c, a) for c, a in zip(asked, answers, strict=True) if c.kind == kind]
        right = sum(c.is_right(a) for c, a in pairs)
        chance = sum(c.chance for c, _ in pairs) / len(pairs)
        scores.append(AnswerScore(kind, len(pairs), right, chance))
    return scores


def write_report(
    target_dir: Path,
    scores: Sequence[AnswerScore],
    examples: Sequence[tuple[Check, str]],
    settings: TeachingSettings,
    seconds: float,
    losses: Sequence[float],
) -> dict[str, Any]:
    """`answers_report.json` beside the weights: accuracy per kind against chance, a few
    answers, the settings and how long training took."""
    report = {
        "scores": [{**asdict(s), "accuracy": s.accuracy} for s in scores],
        "examples": [
            {"question": c.question, "truth": c.truth, "answer": a, "right": c.is_right(a)}
            for c, a in examples
        ],
        "settings": asdict(settings),
        "training_seconds": round(seconds, 1),
        "first_loss": losses[0] if losses else None,
        "last_loss": sum(losses[-20:]) / len(losses[-20:]) if losses else None,
    }
    (target_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as the demo prints it."""
    names = {
        "background": "background colour",
        "count": "number of shapes",
        "shape_colour": "colour of a named shape",
        "text": "text tasks",
    }
    lines = [f"      {'held-out check':<26}{'right':>10}{'accuracy':>10}{'chance':>8}"]
    for s in report["scores"]:
        right = f"{s['right']}/{s['asked']}"
        lines.append(
            f"      {names[s['kind']]:<26}{right:>10}{s['accuracy']:>10.0%}{s['chance']:>8.0%}"
        )
    lines.append(f"      (trained in {report['training_seconds']:.0f} s; greedy answers)")
    return "\n".join(lines)


def _demo_conversations(demo_dir: Path) -> list[list[tuple[str, str]]]:
    """The text conversations of `demo_sharegpt` and the benchmark, as (role, text) turns."""
    import pyarrow.parquet as pq

    from mm_assets.demo.benchmark import BENCHMARK_FILE
    from mm_assets.demo.data import SHAREGPT_FILE

    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    out = []
    for line in (demo_dir / SHAREGPT_FILE).read_text().splitlines():
        turns = json.loads(line)["conversations"]
        out.append([(roles[t["from"]], t["value"]) for t in turns])
    for row in pq.read_table(demo_dir / BENCHMARK_FILE, columns=["messages"]).to_pylist():
        out.append(
            [(m["role"], "".join(p["text"] or "" for p in m["content"])) for m in row["messages"]]
        )
    return out


@dataclass(frozen=True)
class Curriculum:
    """What a build teaches and what it asks afterwards, and what neither may hold."""

    measured: Exclusions  # the demo datasets' and the benchmark's pictures and prompts
    asked: list[Check]  # the held-out checks: never in `measured`
    forbidden: Exclusions  # `measured` and the checks: no lesson holds any of them
    taught: list[Lesson]


def curriculum(demo_dir: Path, settings: TeachingSettings) -> Curriculum:
    """The build's lessons and checks for the demo built in `demo_dir`: the pictures are
    excluded by drawing (`picture_key`), the text conversations by their user turns."""
    from mm_assets.demo.benchmark import benchmark_pictures
    from mm_assets.demo.data import dataset_pictures
    from mm_assets.demo.lessons import check_exclusions, checks, demo_exclusions, lessons

    measured = demo_exclusions(
        [*dataset_pictures(), *benchmark_pictures()], _demo_conversations(demo_dir)
    )
    asked = checks(settings.check_pictures, settings.check_text, settings.seed + 1, measured)
    forbidden = Exclusions(set(measured.pictures), set(measured.prompts))
    forbidden.update(check_exclusions(asked))
    taught = lessons(settings.lessons, settings.seed, forbidden, settings.picture_share)
    return Curriculum(measured, asked, forbidden, taught)


def build_code_key(settings: TeachingSettings) -> str:
    """What the trained target depends on: the demo package's code and data templates,
    the settings and the torch/transformers versions (a kernel change moves weights)."""
    import hashlib
    from importlib import resources

    import transformers

    digest = hashlib.sha256()
    package = resources.files("mm_assets.demo")
    for name in sorted(p.name for p in package.iterdir() if p.name.endswith((".py", ".jinja"))):
        if name not in ("__init__.py", "__main__.py"):  # the entry point trains nothing
            digest.update(name.encode() + package.joinpath(name).read_bytes())
    digest.update(json.dumps(asdict(settings), sort_keys=True).encode())
    digest.update(f"{torch.__version__} {transformers.__version__}".encode())
    return digest.hexdigest()[:16]


def build_trained_target(
    out_dir: Path,
    demo_dir: Path,
    settings: TeachingSettings = TeachingSettings(),
    cache: Path | None = None,
    say: Callable[[str], None] = log.info,
) -> dict[str, Any]:
    """Write the trained demo target to `out_dir` (its datasets and benchmark already
    built in `demo_dir`) and return its answers report. With `cache`, a target built
    before by the same code and settings is copied from there instead of trained."""
    import shutil

    key = build_code_key(settings)
    if cache is not None and (cache / key / REPORT_FILE).is_file():
        shutil.copytree(cache / key, out_dir, dirs_exist_ok=True)
        say(f"the trained target reused from {cache / key}")
        return json.loads((out_dir / REPORT_FILE).read_text())
    report = train_pinned(out_dir, demo_dir, settings, say)
    if cache is not None:
        staged = cache / f".{key}.{time.time_ns()}"
        shutil.copytree(out_dir, staged)
        staged.rename(cache / key)  # whole or not at all
    return report


def train_pinned(
    out_dir: Path, demo_dir: Path, settings: TeachingSettings, say: Callable[[str], None]
) -> dict[str, Any]:
    """`train_and_check` in a child process with `PINNED_KERNELS` set before torch loads
    (see the module's docstring); its progress lines go to `say`."""
    args = [str(out_dir), str(demo_dir), json.dumps(asdict(settings))]
    command = [sys.executable, "-m", "mm_assets.demo.target_training", *args]
    env = os.environ | PINNED_KERNELS
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    for line in child.stdout or ():
        say(line.rstrip())
    if child.wait() != 0:
        raise RuntimeError(f"training the demo target failed (exit {child.returncode}); see above")
    return json.loads((out_dir / REPORT_FILE).read_text())


def train_and_check(
    out_dir: Path, demo_dir: Path, settings: TeachingSettings, say: Callable[[str], None]
) -> dict[str, Any]:
    """Build the random target, teach it, check its answers; returns the report."""
    from mm_assets.demo.data import demo_corpus
    from mm_assets.demo.target import build_demo_target

    plan = curriculum(demo_dir, settings)
    asked, taught = plan.asked, plan.taught
    corpus = [*demo_corpus(demo_dir), *(text for lesson in taught for _, text in lesson.turns)]
    build_demo_target(out_dir, corpus, max_pixels=settings.max_pixels, seed=settings.seed)
    started = time.perf_counter()
    losses = teach(out_dir, taught, settings, say)
    seconds = time.perf_counter() - started
    answers = greedy_answers(out_dir, asked, settings.max_new_tokens)
    examples = [pair for i, pair in enumerate(zip(asked, answers, strict=True)) if i % 17 == 0]
    return write_report(out_dir, score(asked, answers), examples, settings, seconds, losses)


if __name__ == "__main__":  # the child of `train_pinned`
    settings = TeachingSettings(**json.loads(sys.argv[3]))
    train_and_check(Path(sys.argv[1]), Path(sys.argv[2]), settings, lambda x: print(x, flush=True))
