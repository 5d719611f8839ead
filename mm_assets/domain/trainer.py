"""Training loop for the EAGLE-3 draft: epochs over packed batches, a checkpoint of the
training state after every epoch, resume from it, and held-out evaluation.

Deterministic for a seed: the model is initialised under the seed, the batch order of
epoch e is a seeded shuffle, and nothing else draws random numbers, so a run resumed from
an epoch checkpoint ends with the same weights as an uninterrupted one.

Devices: CPU in fp32 (sdpa attention); on CUDA, bf16 autocast. Several GPUs: run the same
code under `torchrun`; when a process group is initialised, each rank takes every
world_size-th batch and gradients are averaged by DistributedDataParallel.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mm_assets.domain.eagle3 import (
    Eagle3Draft,
    StepStats,
    acceptance_length,
    conditional_accuracies,
)
from mm_assets.domain.progress import Progress
from mm_assets.domain.training_data import SampleRef, load_batch, pack


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 3
    learning_rate: float = 3e-4
    batch_tokens: int = 4096
    ttt_steps: int = 3
    step_loss_decay: float = 1.0
    seed: int = 0
    grad_clip: float = 1.0
    device: str = "auto"  # auto | cpu | cuda

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class TrainResult:
    epoch_losses: list[float] = field(default_factory=list)
    batch_losses: list[float] = field(default_factory=list)
    held_out_accuracy: list[float] = field(default_factory=list)
    held_out_acceptance: float = 1.0
    held_out_loss: float = float("nan")
    tokens_per_s: float = 0.0
    trained_tokens: int = 0
    resumed_from_epoch: int = 0


def _fingerprint(settings: TrainSettings, refs: Sequence[SampleRef], model: Eagle3Draft) -> str:
    digest = hashlib.sha256(json.dumps(asdict(settings), sort_keys=True).encode())
    digest.update(json.dumps(model.cfg.as_dict(), sort_keys=True).encode())
    for ref in refs:
        digest.update(f"{ref.row_id}:{ref.path}\n".encode())
    return digest.hexdigest()


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _batch_to(batch, device: torch.device):
    return {
        "input_ids": batch.input_ids.to(device),
        "aux_hidden": batch.aux_hidden.to(device),
        "last_hidden": batch.last_hidden.to(device),
        "loss_mask": batch.loss_mask.to(device),
        "position_ids": batch.position_ids.to(device),
        "segment": batch.segment.to(device),
    }


def evaluate(
    model: Eagle3Draft,
    refs: Sequence[SampleRef],
    settings: TrainSettings,
    full_lm_head: torch.Tensor | None = None,
) -> tuple[float, list[float]]:
    """Held-out loss and per-step conditional accuracy. With the target's full lm_head,
    a step is right only when the draft proposes the target's own greedy token."""
    device = settings.resolved_device()
    model.eval()
    losses, stats = [], []
    head = full_lm_head.to(device) if full_lm_head is not None else None
    with torch.no_grad():
        for group in pack(refs, settings.batch_tokens):
            batch = _batch_to(load_batch(group), device)
            greedy = (
                None if head is None else model.target_greedy_tokens(batch["last_hidden"], head)
            )
            with _autocast(device):
                loss, step_stats = model(
                    **batch,
                    ttt_steps=settings.ttt_steps,
                    decay=settings.step_loss_decay,
                    target_greedy=greedy,
                )
            losses.append(float(loss))
            stats.append(
                [StepStats(s.loss.cpu(), s.correct.cpu(), s.valid.cpu()) for s in step_stats]
            )
    model.train()
    if not stats:
        return float("nan"), [0.0] * settings.ttt_steps
    return sum(losses) / len(losses), conditional_accuracies(stats)


def _save_state(path: Path, state: dict) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(
    model: Eagle3Draft,
    train_refs: Sequence[SampleRef],
    held_out_refs: Sequence[SampleRef],
    settings: TrainSettings,
    state_dir: Path,
    log: Callable[[str], None] = print,
    after_epoch: Callable[[int], None] = lambda epoch: None,
    full_lm_head: torch.Tensor | None = None,
) -> TrainResult:
    """Train `model` in place; resumes from `state_dir` when it holds a matching state."""
    device = settings.resolved_device()
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    runner: torch.nn.Module = model
    if distributed:
        runner = torch.nn.parallel.DistributedDataParallel(model)

    result = TrainResult()
    fingerprint = _fingerprint(settings, train_refs, model)
    state_path = state_dir / "train_state.pt"
    start_epoch = 0
    if state_path.is_file():
        state = torch.load(state_path, map_location=device, weights_only=False)
        if state["fingerprint"] == fingerprint:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            result.epoch_losses, result.batch_losses = state["epoch_losses"], state["batch_losses"]
            start_epoch = result.resumed_from_epoch = state["epoch"]
            log(f"resuming after epoch {start_epoch} from {state_path}")
        else:
            log(f"ignoring {state_path}: it belongs to other data or settings")

    batches = pack(train_refs, settings.batch_tokens)
    started = time.perf_counter()
    for epoch in range(start_epoch, settings.epochs):
        order = list(range(len(batches)))
        random.Random(settings.seed * 1_000_003 + epoch).shuffle(order)
        if world > 1:  # every rank takes the same number of steps, or all-reduce hangs
            order = order[: len(order) - len(order) % world] or order[:1] * world
        epoch_loss, count = 0.0, 0
        progress = Progress(log, f"epoch {epoch + 1}/{settings.epochs}: batch", len(order), 60.0)
        for position, index in enumerate(order):
            progress.update(position)
            if position % world != rank:
                continue
            batch = load_batch(batches[index])
            with _autocast(device):
                loss, _ = runner(
                    **_batch_to(batch, device),
                    ttt_steps=settings.ttt_steps,
                    decay=settings.step_loss_decay,
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
            optimizer.step()
            result.batch_losses.append(loss.item())
            result.trained_tokens += batch.num_tokens
            epoch_loss += result.batch_losses[-1]
            count += 1
        result.epoch_losses.append(epoch_loss / max(count, 1))
        log(f"epoch {epoch + 1}/{settings.epochs}: loss {result.epoch_losses[-1]:.4f}")
        if rank == 0:
            state_dir.mkdir(parents=True, exist_ok=True)
            _save_state(
                state_path,
                {
                    "fingerprint": fingerprint,
                    "epoch": epoch + 1,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch_losses": result.epoch_losses,
                    "batch_losses": result.batch_losses,
                },
            )
        after_epoch(epoch + 1)
    elapsed = time.perf_counter() - started
    result.tokens_per_s = result.trained_tokens / elapsed if elapsed > 0 else 0.0
    result.held_out_loss, result.held_out_accuracy = evaluate(
        model, held_out_refs, settings, full_lm_head
    )
    result.held_out_acceptance = acceptance_length(result.held_out_accuracy)
    return result
