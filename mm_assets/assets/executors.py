"""Where a run's steps execute: `MM_ASSETS_EXECUTOR` picks `in_process` (default),
`multiprocess`, `celery` or `k8s` (docs/scaling.md says how to deploy each).

In process by default: a partition's chain is linear, so nothing would run in parallel,
and each library (transformers, torch) is imported once per run, when a step first needs
it. `multiprocess` gives each step's memory back to the system when it ends (a long run
holding a GPU on a shared box). Every executor runs under a pool watch
(`mm_assets/orchestration/`) that frees the slots of dead runs; the pool's limit holds
across workers, since the run decides when a step may start.
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
