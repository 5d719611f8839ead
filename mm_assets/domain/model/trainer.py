"""Training loop for the EAGLE-3 draft: epochs over packed batches, the training state
saved after every epoch and resumed from, held-out evaluation.

Deterministic for a seed (initialisation, each epoch's batch order, the state noise), so
a resumed run ends with the same weights as an uninterrupted one. CPU runs in fp32; CUDA
under bf16 autocast. Several GPUs run the same code under `torchrun`: the caller hands in
the process group as `Ranks`, where the state is kept as a `StateStore` and the batches
as a `BatchSource` (stored blobs, or fetched from vLLM: `services.online_batches`), so
the loop opens no file or process group and an online run steps through exactly the
batches an offline one does.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import torch

from mm_assets.common.crashpoints import crash_point
from mm_assets.common.hashing import json_sha256
from mm_assets.common.progress import Progress
from mm_assets.domain.model.acceptance import replay_runs
from mm_assets.domain.model.draft_parts import DraftModel, leading_correct
from mm_assets.domain.model.losses import LossRecipe
from mm_assets.domain.model.optimization import Optimizers, optimizers
from mm_assets.domain.model.selection import EpochChoice, Evaluation
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.domain.model.training_data import Batch, SampleRef, load_batch, pack

logger = logging.getLogger(__name__)


class BatchSource(Protocol):
    """The batches of a pass, in the order asked; None for a batch none of whose rows
    could be had this pass (skipped). `label` names the pass in logs (`epoch 2`)."""

    def batches(
        self, groups: Sequence[Sequence[SampleRef]], label: str
    ) -> Iterator[Batch | None]: ...


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
    """The processes training together, and the wrapper that averages their gradients
    (DistributedDataParallel under torchrun). One process, unwrapped, by default."""

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
    batch_learning_rates: list[float] = field(default_factory=list)
    epoch_held_out_losses: list[float] = field(default_factory=list)
    epoch_acceptance: list[float | None] = field(default_factory=list)
    kept_epoch: int = 0
    kept_because: str = ""
    held_out_acceptance: float | None = None  # None: no held-out reply
    held_out_per_position: list[float] = field(default_factory=list)
    held_out_replies: dict[str, list[list[int]]] = field(default_factory=dict)  # `evaluate`
    held_out_loss: float = float("nan")
    tokens_per_s: float = 0.0
    trained_tokens: int = 0
    resumed_from_epoch: int = 0
    batch_plan_sha256: str = ""
    """Equal for equal rows, settings and seed, wherever the hidden states come from."""


def _fingerprint(settings: SpeculatorSettings, refs: Sequence[SampleRef], model: DraftModel) -> str:
    """What a saved training state belongs to: settings, model shape and rows."""
    rows = [[ref.row_id, ref.path] for ref in refs]
    return json_sha256([settings.model_dump(), asdict(model.cfg), rows])


def _autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def evaluate(
    model: DraftModel,
    refs: Sequence[SampleRef],
    settings: SpeculatorSettings,
    full_lm_head: torch.Tensor | None = None,
    device: str = "auto",
    source: BatchSource | None = None,
    label: str = "held-out",
) -> tuple[float, dict[str, list[list[int]]]]:
    """Held-out loss, and per row id the replay (`acceptance`) of each supervised reply.
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
            batch = loaded.to(torch_device)
            greedy = None if head is None else model.target_greedy_tokens(batch.last_hidden, head)
            with _autocast(torch_device):
                loss, steps = model(
                    batch,
                    ttt_steps=settings.ttt_steps,
                    loss=LossRecipe.of(settings.loss, settings.step_loss_decay),
                    target_greedy=greedy,
                )
            losses.append(float(loss))
            lead = leading_correct([s.correct for s in steps], [s.valid for s in steps])
            runs = replay_runs(lead.tolist(), steps[0].valid.tolist(), batch.segment.tolist())
            for segment, accepted in runs:
                replies.setdefault(loaded.row_ids[segment], []).append(accepted)
    model.train()
    return (sum(losses) / len(losses) if losses else float("nan")), replies


def _resume(
    states: StateStore,
    fingerprint: str,
    steps: _Steps,
    result: TrainResult,
    choice: EpochChoice,
) -> int:
    """Load the saved state when it belongs to this run; the epoch to start from."""
    model, optimizer, device = steps.model, steps.optimizer, steps.device
    state = states.load(device)
    if state is None:
        return 0
    if state["fingerprint"] != fingerprint:
        logger.info("ignoring %s: it belongs to other data or settings", states)
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    choice.load_state_dict(state["choice"])
    result.epoch_losses, result.batch_losses = state["epoch_losses"], state["batch_losses"]
    result.batch_learning_rates = state["batch_learning_rates"]
    result.resumed_from_epoch = state["epoch"]
    logger.info("resuming after epoch %s from %s", state["epoch"], states)
    return state["epoch"]


@dataclass
class _Steps:
    """Optimizer steps over packed batches on this rank (every world-th batch)."""

    model: DraftModel
    runner: torch.nn.Module
    optimizer: Optimizers
    settings: SpeculatorSettings
    device: torch.device
    ranks: Ranks
    log: Callable[[int, dict[str, float]], None] = lambda step, metrics: None
    seconds: float = 0.0  # spent stepping, evaluation apart
    done: int = 0  # optimizer steps taken, over every epoch

    def __post_init__(self) -> None:
        self.noise = torch.Generator(device=self.device)

    def epoch(
        self, batches: list[list[SampleRef]], epoch: int, result: TrainResult, source: BatchSource
    ) -> None:
        settings, rank, world = self.settings, self.ranks.rank, self.ranks.world
        mine = rank_batches(batches, settings.seed, epoch, rank, world)
        self.noise.manual_seed(settings.seed * 1_000_003 + epoch * 1_009 + rank)
        losses = []
        started = time.perf_counter()
        progress = Progress(
            logger.info, f"epoch {epoch + 1}/{settings.epochs}: batch", len(mine), 60.0
        )
        for position, batch in enumerate(source.batches(mine, f"epoch {epoch + 1}")):
            progress.update(position)
            if batch is not None:
                losses.append(self.step(batch, result))
            elif world > 1:  # the other ranks would wait for this one's gradients
                raise RuntimeError(
                    f"epoch {epoch + 1}: no row of batch {position} could be had on rank "
                    f"{rank}, and under torchrun every rank must step together; see "
                    "the rejections in the log, then rerun (it resumes from the last epoch)"
                )
        self.seconds += time.perf_counter() - started
        result.batch_losses.extend(losses)
        result.epoch_losses.append(sum(losses) / max(len(losses), 1))
        logger.info("epoch %d/%d: loss %.4f", epoch + 1, settings.epochs, result.epoch_losses[-1])

    def step(self, batch: Batch, result: TrainResult) -> float:
        settings, moved = self.settings, batch.to(self.device)
        if settings.noise_std:
            parts = self.model.cfg.num_aux
            aux = noisy(moved.aux_hidden, settings.noise_std, parts, self.noise)
            moved = replace(moved, aux_hidden=aux)
        with _autocast(self.device):
            loss, _ = self.runner(
                moved,
                ttt_steps=settings.ttt_steps,
                loss=LossRecipe.of(settings.loss, settings.step_loss_decay),
            )
        self.optimizer.zero_grad()
        loss.backward()
        params = [p for p in self.runner.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        result.batch_learning_rates.append(self.optimizer.lr)
        self.optimizer.step()
        result.trained_tokens += batch.num_tokens
        self.done += 1
        self.log(
            self.done, {"train/loss": loss.item(), "train/lr": result.batch_learning_rates[-1]}
        )
        return loss.item()


def noisy(aux: torch.Tensor, std: float, parts: int, generator: torch.Generator) -> torch.Tensor:
    """`aux` ([N, parts·H]: the states side by side) plus Gaussian noise of `std` times
    each state's RMS at each position, so one setting means the same at every layer."""
    n, width = aux.shape
    states = aux.float().view(n, parts, width // parts)
    rms = states.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(states.shape, generator=generator, device=aux.device)
    return (states + std * rms * noise).to(aux.dtype).view(n, width)


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
    """How one training runs, apart from what it learns (`source`: the stored files
    unless given)."""

    device: str = "auto"
    ranks: Ranks = field(default_factory=Ranks)
    source: BatchSource | None = None
    after_epoch: Callable[[int], None] = lambda epoch: None
    log: Callable[[int, dict[str, float]], None] = lambda step, metrics: None
    """Metrics by optimizer step (experiment tracking)."""


def train(
    model: DraftModel,
    train_refs: Sequence[SampleRef],
    held_out_refs: Sequence[SampleRef],
    settings: SpeculatorSettings,
    states: StateStore,
    full_lm_head: torch.Tensor | None = None,
    run: TrainingRun = TrainingRun(),
) -> TrainResult:
    """Train `model` in place; resumes from `states` when they hold a matching state.
    After every epoch the held-out rows are replayed; the weights left in `model` are the
    kept epoch's (`settings.keep`), and the result's held-out figures are that epoch's."""
    ranks, torch_device = run.ranks, resolve_device(run.device)
    model.to(torch_device)
    batches = pack(train_refs, settings.batch_tokens)
    per_epoch = len(rank_batches(batches, settings.seed, 0, ranks.rank, ranks.world))
    schedule = (settings.lr_schedule, settings.warmup_ratio, settings.min_lr_ratio)
    optimizer = optimizers(
        model, settings.optimizer, settings.learning_rate, per_epoch * settings.epochs, schedule
    )
    steps = _Steps(model, ranks.wrap(model), optimizer, settings, torch_device, ranks, run.log)
    result, choice = TrainResult(), EpochChoice(settings.keep, settings.early_stop_patience)
    fingerprint = _fingerprint(settings, train_refs, model)
    start = _resume(states, fingerprint, steps, result, choice)
    steps.done = len(result.batch_losses)
    result.batch_plan_sha256 = batch_plan_sha256(batches, settings, ranks)
    source = run.source or StoredBatches()
    for epoch in range(start, settings.epochs):
        if choice.stop():
            break
        steps.epoch(batches, epoch, result, source)
        label = f"held-out (epoch {epoch + 1})"
        loss, replies = evaluate(
            model, held_out_refs, settings, full_lm_head, run.device, source, label
        )
        evaluation = Evaluation.replayed(epoch + 1, loss, replies, settings.ttt_steps)
        choice.record(evaluation, model)
        run.log(steps.done, evaluation.metrics(result.epoch_losses[-1]))
        if ranks.rank == 0:
            states.save(_state(fingerprint, epoch + 1, steps, choice, result))
            crash_point("after_epoch")
        run.after_epoch(epoch + 1)
    if steps.seconds > 0:
        result.tokens_per_s = result.trained_tokens / steps.seconds
    choice.restore(model)
    kept = choice.kept()
    result.epoch_held_out_losses = [e.loss for e in choice.evaluations]
    result.epoch_acceptance = [e.acceptance for e in choice.evaluations]
    result.kept_epoch, result.kept_because = kept.epoch, choice.because()
    result.held_out_loss, result.held_out_replies = kept.loss, kept.replies
    result.held_out_acceptance, result.held_out_per_position = kept.acceptance, kept.per_position
    logger.info("kept epoch %d (%s)", kept.epoch, result.kept_because)
    return result


def _state(
    fingerprint: str, epoch: int, steps: _Steps, choice: EpochChoice, result: TrainResult
) -> dict[str, Any]:
    """What `_resume` needs to go on after `epoch` as if never stopped."""
    return {
        "fingerprint": fingerprint,
        "epoch": epoch,
        "model": steps.model.state_dict(),
        "optimizer": steps.optimizer.state_dict(),
        "choice": choice.state_dict(),
        "epoch_losses": result.epoch_losses,
        "batch_losses": result.batch_losses,
        "batch_learning_rates": result.batch_learning_rates,
    }
