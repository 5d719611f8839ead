"""The mm_assets code location: dataset → images → conversations → tokens → hidden states
→ trained EAGLE-3 speculator → benchmarked per category.

`dagster dev`, `dagster asset materialize -m mm_assets.definitions` and `dg launch` load
this module. Loading it imports neither torch nor transformers (the steps do, see
`assets/__init__.py`), so a CLI run or a UI reload starts in about a second; and it
changes nothing: the instance (`DAGSTER_HOME`) is the caller's.
"""

import dagster as dg

from mm_assets.assets.benchmarks import draft_benchmark, speculator_benchmark
from mm_assets.assets.drafts import trained_draft
from mm_assets.assets.executors import step_executor
from mm_assets.assets.ingest import coco_image_availability, raw_dataset
from mm_assets.assets.maintenance import prune_embedded_images
from mm_assets.assets.model import hidden_states, trained_speculator
from mm_assets.assets.prep import normalized_conversations, tokenized_samples
from mm_assets.assets.resources import StorageResource, TargetModelResource, VllmResource
from mm_assets.assets.responses import target_responses
from mm_assets.assets.schedules import refresh_raw_datasets, refresh_raw_datasets_job

# One run covers one partitioning: a dataset's chain, or a draft of several datasets.
dataset_chain_job = dg.define_asset_job(
    "dataset_chain",
    selection=dg.AssetSelection.assets(speculator_benchmark).upstream(),
    description="A dataset's whole chain, down to its own draft (`trained_speculator`) "
    "benchmarked (`speculator_benchmark`); on a benchmark's partition, its preparation "
    "(the `prepare` job does only that).",
)
prepare_job = dg.define_asset_job(
    "prepare",
    selection=dg.AssetSelection.assets(normalized_conversations).upstream(),
    description="A partition's preparation, no server: rows loaded, images probed, "
    "conversations normalized. What a benchmark's partition needs before drafts are "
    "measured on it.",
)
drafts_job = dg.define_asset_job(
    "drafts",
    selection=dg.AssetSelection.assets(trained_draft, draft_benchmark),
    description="A draft trained on several datasets, from their stored hidden states, "
    "and benchmarked on its sources' benchmarks (`draft_benchmark`).",
)

defs = dg.Definitions(
    assets=[
        raw_dataset,
        coco_image_availability,
        normalized_conversations,
        target_responses,
        tokenized_samples,
        hidden_states,
        trained_speculator,
        trained_draft,
        speculator_benchmark,
        draft_benchmark,
    ],
    jobs=[
        refresh_raw_datasets_job,
        dataset_chain_job,
        prepare_job,
        drafts_job,
        prune_embedded_images,
    ],
    schedules=[refresh_raw_datasets],
    executor=step_executor(),  # in the run's process unless MM_ASSETS_EXECUTOR says otherwise
    resources={
        "storage": StorageResource(),
        "target_model": TargetModelResource(),
        "vllm": VllmResource(),
    },
)
