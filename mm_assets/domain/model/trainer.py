"""Training loop for the EAGLE-3 draft: epochs over packed batches, a checkpoint of the
training state after every epoch, resume from it, and held-out evaluation.

Deterministic for a seed: the model is initialised under the seed, the batch order of
epoch e is a seeded shuffle, and nothing else draws random numbers, so a run resumed from
an epoch checkpoint ends with the same weights as an uninterrupted one.

Devices: CPU in fp32 (sdpa attention); on CUDA, bf16 autocast. Several GPUs: run the same
code under `torchrun`; the caller hands in the process group as `Ranks` (each rank takes
every world-th batch; the wrapper, DistributedDataParallel, averages gradients) and where
the state is kept as a `StateStore`, so the loop itself opens no file and no process group.
Nor does it read hidden states itself: a `BatchSource` hands it each batch, from the
stored blobs (`StoredBatches`) or fetched from vLLM while it trains (`services.online_batches`),
so an online run steps through exactly the batches an offline one does.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mm_assets.common.crashpoints import crash_point
from mm_assets.common.hashing import json_sha256
from mm_assets.common.progress import Progress
from mm_assets.domain.model.acceptance import replay_runs, summarize
from mm_assets.domain.model.eagle3 import Eagle3Draft, leading_correct
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.domain.model.training_data import Batch, SampleRef, load_batch, pack

logger = logging.getLogger(__name__)


class BatchSource(Protocol):
    """The hidden states of a pass's batches, built in the order asked; None for a batch
    none of whose rows could be had this pass (skipped)."""

    def batches(self, groups: Sequence[Sequence[SampleRef]], label: str) -> Iterator[Batch | None]:
        """`label` names the pass in logs and reports (`epoch 2`, `held-out`)."""
        ...


class StoredBatches:
    """Batches read from the blob files their rows name (`SampleRef.path`)."""

    def batches(self, groups: Sequence[Sequence[SampleRef]], label: str) -> Iterator[Batch | None]:
        for group in groups:
            yield load_batch(group)


class StateStore(Protocol):
    """Where the loop keeps its state after each epoch (`storage.checkpoints.TrainStateFile`)."""

    def load(self, device: torch.device) -> dict[str, Any] | None: ...
    def save(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Ranks:
    """The processes training together: this one's rank, how many there are, and the
    wrapper that averages their gradients (DistributedDataParallel under torchrun, see
    `services.training`). One process, unwrapped, by default."""

    rank: int = 0
    world: int = 1
    wrap: Callable[[torch.nn.Module], torch.nn.Module] = lambda model: model


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class TrainResult:
    epoch_losses: list[float] = field(default_factory=list)
    batch_losses: list[float] = field(default_factory=list)
    held_out_acceptance: float | None = None
    """Estimated by replaying speculative decoding over the held-out replies (None: no
    held-out reply)."""
    held_out_per_position: list[float] = field(default_factory=list)
    held_out_replies: dict[str, list[list[int]]] = field(default_factory=dict)
    """Row id -> per supervised reply, the draft tokens accepted at each verification."""
    held_out_loss: float = float("nan")
    tokens_per_s: float = 0.0
    trained_tokens: int = 0
    resumed_from_epoch: int = 0
    batch_plan_sha256: str = ""
    """The rows of every batch this rank trains on, in order, over all epochs: equal for
    equal rows, settings and seed, wherever the hidden states come from."""


def _fingerprint(
    settings: SpeculatorSettings, refs: Sequence[SampleRef], model: Eagle3Draft
) -> str:
    """What a saved training state belongs to: settings, model shape and rows."""
    rows = [[ref.row_id, ref.path] for ref in refs]
    return json_sha256([settings.model_dump(), model.cfg.as_dict(), rows])


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _batch_to(batch, device: torch.device):
    fields = ("input_ids", "aux_hidden", "last_hidden", "loss_mask", "position_ids", "segment")
    return {name: getattr(batch, name).to(device) for name in fields}


def evaluate(
    model: Eagle3Draft,
    refs: Sequence[SampleRef],
    settings: SpeculatorSettings,
    full_lm_head: torch.Tensor | None = None,
    device: str = "auto",
    source: BatchSource | None = None,
    label: str = "held-out",
) -> tuple[float, dict[str, list[list[int]]]]:
    """Held-out loss, and speculative decoding replayed over every supervised reply (see
    `acceptance`): row id -> per reply, the draft tokens accepted at each verification.
    With the target's full lm_head, a draft token is right only when it is the target's
    own greedy token (what vLLM accepts); without, the teacher's best in the draft vocab."""
    torch_device = resolve_device(device)
    model.eval()
    losses, replies = [], {}
    head = full_lm_head.to(torch_device) if full_lm_head is not None else None
    source = source or StoredBatches()
    with torch.no_grad():
        for loaded in source.batches(pack(refs, settings.batch_tokens), label):
            if loaded is None:
                continue
            batch = _batch_to(loaded, torch_device)
            greedy = (
                None if head is None else model.target_greedy_tokens(batch["last_hidden"], head)
            )
            with _autocast(torch_device):
                loss, steps = model(
                    **batch,
                    ttt_steps=settings.ttt_steps,
                    decay=settings.step_loss_decay,
                    target_greedy=greedy,
                )
            losses.append(float(loss))
            lead = leading_correct([s.correct for s in steps], [s.valid for s in steps])
            runs = replay_runs(lead.tolist(), steps[0].valid.tolist(), batch["segment"].tolist())
            for segment, accepted in runs:
                replies.setdefault(loaded.row_ids[segment], []).append(accepted)
    model.train()
    return (sum(losses) / len(losses) if losses else float("nan")), replies


def _resume(
    states: StateStore,
    fingerprint: str,
    model: Eagle3Draft,
    optimizer: torch.optim.Optimizer,
    result: TrainResult,
    device: torch.device,
) -> int:
    """Load the saved state when it belongs to this run; the epoch to start from."""
    state = states.load(device)
    if state is None:
        return 0
    if state["fingerprint"] != fingerprint:
        logger.info("ignoring %s: it belongs to other data or settings", states)
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    result.epoch_losses, result.batch_losses = state["epoch_losses"], state["batch_losses"]
    result.resumed_from_epoch = state["epoch"]
    logger.info("resuming after epoch %s from %s", state["epoch"], states)
    return state["epoch"]


@dataclass
class _Steps:
    """Optimizer steps over packed batches on this rank (every world-th batch)."""

    runner: torch.nn.Module
    optimizer: torch.optim.Optimizer
    settings: SpeculatorSettings
    device: torch.device
    rank: int
    world: int

    def epoch(
        self, batches: list[list[SampleRef]], epoch: int, result: TrainResult, source: BatchSource
    ) -> None:
        settings = self.settings
        mine = rank_batches(batches, settings.seed, epoch, self.rank, self.world)
        losses = []
        progress = Progress(
            logger.info, f"epoch {epoch + 1}/{settings.epochs}: batch", len(mine), 60.0
        )
        for position, batch in enumerate(source.batches(mine, f"epoch {epoch + 1}")):
            progress.update(position)
            if batch is not None:
                losses.append(self.step(batch, result))
            elif self.world > 1:  # the other ranks would wait for this one's gradients
                raise RuntimeError(
                    f"epoch {epoch + 1}: no row of batch {position} could be had on rank "
                    f"{self.rank}, and under torchrun every rank must step together; see "
                    "the rejections in the log, then rerun (it resumes from the last epoch)"
                )
        result.batch_losses.extend(losses)
        result.epoch_losses.append(sum(losses) / max(len(losses), 1))
        logger.info("epoch %d/%d: loss %.4f", epoch + 1, settings.epochs, result.epoch_losses[-1])

    def step(self, batch: Batch, result: TrainResult) -> float:
        with _autocast(self.device):
            loss, _ = self.runner(
                **_batch_to(batch, self.device),
                ttt_steps=self.settings.ttt_steps,
                decay=self.settings.step_loss_decay,
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for p in self.runner.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(params, self.settings.grad_clip)
        self.optimizer.step()
        result.trained_tokens += batch.num_tokens
        return loss.item()


def rank_batches(
    batches: list[list[SampleRef]], seed: int, epoch: int, rank: int = 0, world: int = 1
) -> list[list[SampleRef]]:
    """The batches `rank` trains on in `epoch`, in order: a seeded shuffle of all of them,
    of which each rank takes every world-th (the same number each, or all-reduce hangs)."""
    order = list(range(len(batches)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    if world > 1:
        order = order[: len(order) - len(order) % world] or order[:1] * world
    return [batches[index] for position, index in enumerate(order) if position % world == rank]


def batch_plan_sha256(
    batches: list[list[SampleRef]], settings: SpeculatorSettings, ranks: Ranks
) -> str:
    """The rows of every batch `ranks.rank` trains on, epoch by epoch (`TrainResult`)."""
    return json_sha256(
        [
            [
                [ref.row_id for ref in group]
                for group in rank_batches(batches, settings.seed, e, ranks.rank, ranks.world)
            ]
            for e in range(settings.epochs)
        ]
    )


@dataclass(frozen=True)
class TrainingRun:
    """How one training runs, apart from what it learns: the device, this process's
    rank among the ranks, where each batch's states come from (the stored files unless
    a source fetches them), and what to do after each saved epoch."""

    device: str = "auto"
    ranks: Ranks = field(default_factory=Ranks)
    source: BatchSource | None = None
    after_epoch: Callable[[int], None] = lambda epoch: None


def train(
    model: Eagle3Draft,
    train_refs: Sequence[SampleRef],
    held_out_refs: Sequence[SampleRef],
    settings: SpeculatorSettings,
    states: StateStore,
    full_lm_head: torch.Tensor | None = None,
    run: TrainingRun = TrainingRun(),
) -> TrainResult:
    """Train `model` in place; resumes from `states` when they hold a matching state."""
    device, ranks, after_epoch = run.device, run.ranks, run.after_epoch
    torch_device = resolve_device(device)
    model.to(torch_device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    steps = _Steps(ranks.wrap(model), optimizer, settings, torch_device, ranks.rank, ranks.world)

    result = TrainResult()
    fingerprint = _fingerprint(settings, train_refs, model)
    start = _resume(states, fingerprint, model, optimizer, result, torch_device)
    batches = pack(train_refs, settings.batch_tokens)
    result.batch_plan_sha256 = batch_plan_sha256(batches, settings, ranks)
    source = run.source or StoredBatches()
    started = time.perf_counter()
    for epoch in range(start, settings.epochs):
        steps.epoch(batches, epoch, result, source)
        if ranks.rank == 0:
            state = {
                "fingerprint": fingerprint,
                "epoch": epoch + 1,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch_losses": result.epoch_losses,
                "batch_losses": result.batch_losses,
            }
            states.save(state)
            crash_point("after_epoch")
        after_epoch(epoch + 1)
    elapsed = time.perf_counter() - started
    result.tokens_per_s = result.trained_tokens / elapsed if elapsed > 0 else 0.0
    result.held_out_loss, result.held_out_replies = evaluate(
        model, held_out_refs, settings, full_lm_head, device, source, "held-out (trained)"
    )
    summary = summarize(replies_of(result.held_out_replies), settings.ttt_steps)
    result.held_out_acceptance = summary.acceptance_length
    result.held_out_per_position = summary.per_position
    return result


def replies_of(walks: dict[str, list[list[int]]]) -> list[list[int]]:
    return [reply for row in walks.values() for reply in row]
