"""Train a partition's EAGLE-3 draft outside Dagster, on one or several GPUs.

    torchrun --nproc_per_node 8 -m mm_assets.train --partition sharegpt4v_coco --epochs 3

Reads the partition's `tokenized_samples`, `hidden_states_manifest` and
`token_frequencies` from $MM_ASSETS_HOME (materialize `hidden_states` first) and writes
the same checkpoint the `trained_speculator` asset writes; like the asset, it reuses a
checkpoint trained from identical inputs and settings unless `--retrain`. Under torchrun
each rank trains on its share of the batches with DistributedDataParallel (NCCL on GPUs,
gloo on CPU); rank 0 saves. Resumes from the last epoch checkpoint like the asset does.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from mm_assets.domain.speculator_training import train_speculator
from mm_assets.domain.trainer import TrainSettings
from mm_assets.resources import StorageResource, TargetModelResource


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m mm_assets.train")
    parser.add_argument("--partition", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--draft-vocab-size", type=int, default=32000)
    parser.add_argument("--held-out-fraction", type=float, default=0.1)
    parser.add_argument("--speculative-tokens", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--retrain",
        action="store_true",
        help="train even when the checkpoint already came from identical inputs and settings",
    )
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = "cpu"
    if world > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            device = "cuda"
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    elif torch.cuda.is_available():
        device = "cuda"
    storage, target = StorageResource(), TargetModelResource()
    job = target.speculator_job(
        args.partition,
        storage.tables().root,
        TrainSettings(
            epochs=args.epochs,
            learning_rate=args.learning_rate,
            batch_tokens=args.batch_tokens,
            ttt_steps=args.ttt_steps,
            seed=args.seed,
            device=device,
        ),
        draft_vocab_size=args.draft_vocab_size,
        held_out_fraction=args.held_out_fraction,
        speculative_tokens=args.speculative_tokens,
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    outcome = train_speculator(
        job, storage.tables(), lambda m: print(f"[rank {rank}] {m}"), reuse=not args.retrain
    )
    if rank == 0:
        trained, untrained = outcome.result.held_out_acceptance, outcome.untrained_acceptance
        print(
            f"checkpoint {outcome.checkpoint}; held-out acceptance estimate {trained:.3f} "
            f"(untrained {untrained:.3f})"
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
