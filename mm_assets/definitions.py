"""The mm_assets code location: dataset → images → conversations → tokens → hidden states
→ trained EAGLE-3 speculator.

`dagster dev` and `dagster asset materialize -m mm_assets.definitions` load this module.
"""

import dagster as dg

from mm_assets import settings
from mm_assets.assets.ingest import coco_image_availability, raw_dataset
from mm_assets.assets.model import hidden_states, trained_speculator
from mm_assets.assets.prep import normalized_conversations, tokenized_samples
from mm_assets.resources import StorageResource, TargetModelResource, VllmResource
from mm_assets.schedules import refresh_raw_datasets, refresh_raw_datasets_job

settings.ensure_dagster_home()

# Each step runs in its own process (a vLLM server or training frees its memory with it).
# Forked from a server that imported this module and transformers' processors once, a
# step starts in about a second instead of importing them again (~6 s + ~4 s on two
# cores), which dominated cached reruns. Loading this module stays free of transformers.
PRELOADED = ["mm_assets.definitions", "transformers.processing_utils"]
step_processes = dg.multiprocess_executor.configured(
    {"start_method": {"forkserver": {"preload_modules": PRELOADED}}}
)

defs = dg.Definitions(
    assets=[
        raw_dataset,
        coco_image_availability,
        normalized_conversations,
        tokenized_samples,
        hidden_states,
        trained_speculator,
    ],
    jobs=[refresh_raw_datasets_job],
    schedules=[refresh_raw_datasets],
    executor=step_processes,
    resources={
        "storage": StorageResource(),
        "target_model": TargetModelResource(),
        "vllm": VllmResource(),
    },
)
