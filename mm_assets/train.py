"""Train a partition's EAGLE-3 draft outside Dagster, on one or several GPUs.

    torchrun --nproc_per_node 8 -m mm_assets.train --partition sharegpt4v_coco --epochs 3

Reads the partition's `tokenized_samples`, `hidden_states_manifest` and
`token_frequencies` from $MM_ASSETS_HOME, or from $MM_ASSETS_OBJECT_STORE when set
(materialize `hidden_states` first), and writes the same checkpoint the
`trained_speculator` asset writes; like the asset, it reuses a checkpoint trained from
identical inputs and settings unless `--retrain`, and resumes from the last epoch
checkpoint. Under torchrun each rank trains on its share of the batches with
DistributedDataParallel (NCCL on GPUs, gloo on CPU); rank 0 saves. The options are the
fields of `SpeculatorSettings`, with the asset's names and defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from mm_assets.common import paths
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.services.target import TargetModel
from mm_assets.services.training import SpeculatorJob, train_speculator
from mm_assets.storage import open_tables
from mm_assets.storage.object_store import ENV_VAR as OBJECT_STORE_ENV


def parser() -> argparse.ArgumentParser:
    """One option per settings field (`--learning-rate` for `learning_rate`)."""
    out = argparse.ArgumentParser(prog="python -m mm_assets.train")
    out.add_argument("--partition", required=True, help="Dataset name (registry entry).")
    for name, info in SpeculatorSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        scalar = info.annotation in (int, float, str)
        kind: Any = info.annotation if scalar else json.loads
        help_text = f"{info.description} ({'' if scalar else 'JSON; '}default: {info.default})"
        out.add_argument(flag, dest=name, type=kind, default=info.default, help=help_text)
    retrain = "train even when the checkpoint already came from identical inputs and settings"
    out.add_argument("--retrain", action="store_true", help=retrain)
    return out


def _device(world: int) -> str:
    """Initialise the process group under torchrun; the device this rank trains on."""
    if world > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return "cuda" if torch.cuda.is_available() else "cpu"


def main() -> None:
    args = vars(parser().parse_args())
    partition, retrain = args.pop("partition"), args.pop("retrain")
    settings = SpeculatorSettings(**args)
    device = _device(int(os.environ.get("WORLD_SIZE", "1")))
    target = TargetModel(paths.default_target_model())
    root = paths.home()
    tables = open_tables(root, os.environ.get(OBJECT_STORE_ENV))
    job = SpeculatorJob.for_target(partition, root, target, settings, tables)
    rank = dist.get_rank() if dist.is_initialized() else 0
    logging.basicConfig(stream=sys.stdout, format=f"[rank {rank}] %(message)s")
    logging.getLogger("mm_assets").setLevel(logging.INFO)  # epochs and progress; others warn
    outcome = train_speculator(job, tables, not retrain, device)
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
