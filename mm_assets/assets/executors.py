"""Where a run's steps execute.

Default: in the run's own process, one step after another. The chain of a partition is
linear, so nothing runs in parallel anyway, and each library (transformers for
tokenization, torch for training) is imported once per run, when a step first needs it:
the least fixed cost per CLI run (BENCHMARKS.md, "Fixed cost of a CLI run").

`MM_ASSETS_EXECUTOR` picks another:
- `multiprocess`: each step in its own process (forked from that preloading server), so a
  step's memory is returned to the system when it ends, which matters on a shared box
  where a long run holds a GPU between steps;
- `celery`: each step is a task on a Celery queue (`dagster-celery`), run by whichever
  worker takes it. Accelerator steps go to the `accelerator` queue, the others to
  `dagster`: start GPU workers with `-q accelerator`, CPU workers with `-q dagster`.
  Broker and result backend: `MM_ASSETS_CELERY_BROKER` (default
  `redis://localhost:6379/0`) and `MM_ASSETS_CELERY_BACKEND` (default: the broker);
- `k8s`: each step is a Kubernetes Job (`dagster-k8s`), in a deployment whose run launcher
  is the `K8sRunLauncher`; accelerator steps ask for `MM_ASSETS_ACCELERATOR_GPUS` GPUs
  (default 1).
Workers must see the same storage root (`MM_ASSETS_HOME`) and the same environment; see
docs/scaling.md.

Every executor runs under a pool watch (`mm_assets/orchestration/`): while a step waits
for a slot of its pool (the accelerator), slots held by runs whose worker died are freed.
The pool's limit holds across workers: the run decides when a step may start, before it is
sent to one.
"""

from __future__ import annotations

import os
from typing import Any

import dagster as dg

from mm_assets.orchestration.wiring import watch_pools_of

PRELOADED = ["mm_assets.definitions", "mm_assets.services.preload"]
EXECUTORS = ("in_process", "multiprocess", "celery", "k8s")
CELERY_QUEUE_TAG = "dagster-celery/queue"  # dagster_celery.tags, without importing it here
K8S_CONFIG_TAG = "dagster-k8s/config"  # dagster_k8s.job.USER_DEFINED_K8S_CONFIG_KEY


def step_executor() -> dg.ExecutorDefinition:
    """The executor `MM_ASSETS_EXECUTOR` names (module docstring), under a watch that
    frees pool slots held by dead runs."""
    choice = os.environ.get("MM_ASSETS_EXECUTOR", "in_process")
    if choice == "in_process":
        return watch_pools_of(dg.in_process_executor)
    if choice == "multiprocess":
        return watch_pools_of(dg.multiprocess_executor).configured(
            {"start_method": {"forkserver": {"preload_modules": PRELOADED}}}
        )
    if choice == "celery":
        from dagster_celery import celery_executor

        broker = os.environ.get("MM_ASSETS_CELERY_BROKER", "redis://localhost:6379/0")
        backend = os.environ.get("MM_ASSETS_CELERY_BACKEND", broker)
        return watch_pools_of(celery_executor).configured({"broker": broker, "backend": backend})
    if choice == "k8s":
        from dagster_k8s import k8s_job_executor

        return watch_pools_of(k8s_job_executor)
    raise ValueError(f"MM_ASSETS_EXECUTOR={choice!r}: use one of {', '.join(EXECUTORS)}")


def accelerator_step_tags() -> dict[str, Any]:
    """Tags of the steps that hold the accelerator: the Celery queue GPU workers listen
    on, and the GPUs a step's Kubernetes Job asks for. Other executors ignore them."""
    tags: dict[str, Any] = {CELERY_QUEUE_TAG: "accelerator"}
    gpus = int(os.environ.get("MM_ASSETS_ACCELERATOR_GPUS", "1"))
    if gpus:
        limits = {"nvidia.com/gpu": str(gpus)}
        tags[K8S_CONFIG_TAG] = {"container_config": {"resources": {"limits": limits}}}
    return tags
