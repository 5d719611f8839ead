"""Train a draft (a dataset's, or a `drafts:` entry's) outside Dagster, on one or
several GPUs.

    torchrun --nproc_per_node 8 -m mm_assets.train --partition sharegpt4v_coco --epochs 3

Reads what the `trained_speculator` asset reads (its sources' stored tables and hidden
states under $MM_ASSETS_HOME or $MM_ASSETS_OBJECT_STORE; with `--hidden-states online`,
each rank's batches fetched from the fleet at $MM_ASSETS_VLLM_URLS) and writes the same
checkpoint, reused or resumed as the asset does unless `--retrain`. Under torchrun each
rank trains its share of the batches with DistributedDataParallel (NCCL on GPUs, gloo on
CPU); rank 0 saves. Options are the asset's settings, by the same names; a value not given
comes from the registry entry, else the default.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import torch
import torch.distributed as dist

from mm_assets.common import paths
from mm_assets.domain.model.hidden_states import ExtractionSettings
from mm_assets.domain.model.settings import OnlineSettings, SpeculatorSettings, TrackingSettings
from mm_assets.registry import DatasetSpec, DraftSpec
from mm_assets.services import settings as settings_of
from mm_assets.services.engine import Serving, VllmEngine
from mm_assets.services.media import sources_media_root
from mm_assets.services.online_batches import OnlineStates
from mm_assets.services.target import TargetModel
from mm_assets.services.tracking import Tracking
from mm_assets.services.training import SpeculatorJob, train_speculator
from mm_assets.storage import TableStore, open_tables
from mm_assets.storage.blobs import BlobStore
from mm_assets.storage.layout import StorageLayout
from mm_assets.storage.object_store import ENV_VAR as OBJECT_STORE_ENV


def parser() -> argparse.ArgumentParser:
    """One option per settings field (`--learning-rate` for `learning_rate`); a value not
    given comes from the dataset's registry entry (`settings.trained_speculator`), else
    the field's default, as for the asset."""
    out = argparse.ArgumentParser(prog="python -m mm_assets.train")
    out.add_argument(
        "--partition", required=True, help="A dataset's name, or a drafts: entry's (registry)."
    )
    for model in (SpeculatorSettings, OnlineSettings, TrackingSettings):
        for name, info in model.model_fields.items():
            choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else None
            scalar = info.annotation in (int, float, str) or choices is not None
            kind: Any = (str if choices else info.annotation) if scalar else json.loads
            help_text = f"{info.description} ({'' if scalar else 'JSON; '}default: {info.default})"
            out.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                type=kind,
                choices=choices,
                default=argparse.SUPPRESS,
                help=help_text,
            )
    retrain = "train from the first epoch even when the checkpoint came from identical inputs"
    out.add_argument("--retrain", action="store_true", help=retrain)
    return out


def _device(world: int) -> str:
    """Initialise the process group under torchrun; the device this rank trains on."""
    if world > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return "cuda" if torch.cuda.is_available() else "cpu"


def _online(
    draft: DraftSpec,
    registry: Mapping[str, DatasetSpec],
    online: OnlineSettings,
    target: TargetModel,
    root: Path,
    tables: TableStore,
) -> OnlineStates | None:
    """Online: the states its first source's `hidden_states` settings describe (as for
    the asset), from the fleet (`MM_ASSETS_VLLM_URLS`) or, in a single process, a server
    started here."""
    if online.hidden_states == "stored":
        return None
    engine = VllmEngine.from_environment()
    if engine.managed and dist.is_initialized():
        sys.exit(
            "online hidden states under torchrun need a fleet every rank shares: start vLLM "
            "extraction servers and set MM_ASSETS_VLLM_URLS (each rank fetches its batches)"
        )
    sources = [registry[name] for name in draft.sources]
    extraction = settings_of.resolve(sources[0], "hidden_states", ExtractionSettings, {})
    rank = dist.get_rank() if dist.is_initialized() else 0
    log = StorageLayout(root).log(f"vllm_online_train_rank{rank}")
    images = sources_media_root(sources, tables, root)
    serving = Serving.for_target(engine, target.local_dir, images, log)
    return OnlineStates.for_target(target, serving, extraction, online, BlobStore(root))


def main() -> None:
    args = vars(parser().parse_args())
    partition, retrain = args.pop("partition"), args.pop("retrain")
    registry = settings_of.datasets()
    drafts = settings_of.drafts(registry)
    if partition not in drafts:
        known = ", ".join(sorted(drafts))
        sys.exit(f"unknown draft {partition!r}; a dataset or a drafts: entry: {known}")
    draft = drafts[partition]
    settings = settings_of.resolve(draft, "trained_speculator", SpeculatorSettings, args)
    online = settings_of.resolve(draft, "trained_speculator", OnlineSettings, args)
    device = _device(int(os.environ.get("WORLD_SIZE", "1")))
    rank = dist.get_rank() if dist.is_initialized() else 0
    logging.basicConfig(stream=sys.stdout, format=f"[rank {rank}] %(message)s")
    logging.getLogger("mm_assets").setLevel(logging.INFO)  # epochs and progress; others warn
    target = TargetModel(paths.default_target_model())
    root = paths.home()
    tables = open_tables(root, os.environ.get(OBJECT_STORE_ENV))
    states = _online(draft, registry, online, target, root, tables)
    job = SpeculatorJob.for_draft(draft, root, target, settings, tables, states)
    tracked = settings_of.resolve(draft, "trained_speculator", TrackingSettings, args)
    tracking = Tracking(tracked, f"torchrun-{time.strftime('%Y%m%dT%H%M%S')}")
    outcome = train_speculator(job, draft, tables, not retrain, device, tracking)
    if rank == 0:
        trained, untrained = outcome.result.held_out_acceptance, outcome.untrained_acceptance
        print(
            f"checkpoint {outcome.checkpoint}; held-out acceptance estimate {trained} "
            f"(untrained {untrained}); none without held-out replies"
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
