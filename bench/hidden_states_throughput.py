"""Hidden-state throughput: the `hidden_states` asset vs a bare concurrent client loop.

Same vLLM server (CPU engine, demo target), same prompts (1,200 synthetic ShareGPT4V rows
through Chat with their images, and the text-only demo rows through Completions), same
concurrency, one run; the two are interleaved twice to even out warm-up and noise. The
bare loop only sends requests (and deletes the files); the asset also plans, verifies
ids, validates and stores every file. Also reports stored bytes per token against
n_layers × H × dtype bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

CONCURRENCY = 8
PARTITIONS = ("bench_multimodal", "demo_sharegpt")
MULTIMODAL_ROWS = 1200


def _rows(home: Path) -> list[dict]:
    from mm_assets.storage import TableStore

    tables = TableStore(home)
    return [r for p in PARTITIONS for r in tables.iter_rows("tokenized_samples", p)]


async def _bare_loop(base_url: str, api_key: str, rows: list[dict]) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = (await client.models.list()).data[0].id
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def one(row: dict) -> None:
        async with semaphore:
            if row["messages"]:
                r = await client.chat.completions.create(
                    model=model,
                    messages=json.loads(row["messages"]),
                    max_tokens=1,
                    extra_body={"add_generation_prompt": False, "return_token_ids": True},
                )
            else:
                r = await client.completions.create(
                    model=model, prompt=row["input_ids"], max_tokens=1,
                    extra_body={"return_token_ids": True},
                )  # fmt: skip
            path = r.model_dump()["kv_transfer_params"]["hidden_states_path"]
            for p in (path, path + ".lock"):
                Path(p).unlink(missing_ok=True)

    started = time.perf_counter()
    await asyncio.gather(*(one(r) for r in rows))
    elapsed = time.perf_counter() - started
    await client.close()
    return elapsed


def _asset_run(home: Path, base_url: str, api_key: str, attempt: int) -> tuple[float, dict]:
    import dagster as dg

    from mm_assets.assets.resources import StorageResource, VllmResource
    from mm_assets.definitions import defs

    storage_root = home / f"asset_run_{attempt}"
    for partition in PARTITIONS:  # fresh blob store, same tokenized tables
        for table in ("tokenized_samples",):
            src = home / "tables" / table / f"dataset={partition}" / "data.parquet"
            dest = storage_root / "tables" / table / f"dataset={partition}" / "data.parquet"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(src.read_bytes())
    started = time.perf_counter()
    metadata = {}
    for partition in PARTITIONS:
        result = dg.materialize(
            [defs.get_assets_def("hidden_states")],
            partition_key=partition,
            resources={
                **defs.resources,
                "storage": StorageResource(root=str(storage_root)),
                "vllm": VllmResource(
                    base_urls=[base_url],
                    api_key=api_key,
                    connector_dir=str(home / "blobs" / "incoming" / "bench"),
                ),
            },
            run_config={"ops": {"hidden_states": {"config": {"concurrency": CONCURRENCY}}}},
            instance=dg.DagsterInstance.ephemeral(),
        )
        (mat,) = result.asset_materializations_for_node("hidden_states")
        metadata[partition] = {k: v.value for k, v in mat.metadata.items()}
    return time.perf_counter() - started, metadata


def run(home: Path) -> dict:
    """Must run in a fresh process: the registry is read when mm_assets is imported."""
    from bench.synthetic import write_dataset

    data = write_dataset(home / "bench", MULTIMODAL_ROWS, distinct_images=300)
    (home / "datasets.yaml").write_text(
        f"bench_multimodal:\n  path: {data}\n  format: sharegpt4v\n"
        f"  image_root: {home / 'bench' / 'coco'}\n  image_path_strip_prefix: 'coco/'\n"
    )
    os.environ["MM_ASSETS_HOME"] = str(home)
    os.environ["MM_ASSETS_DATASETS"] = str(home / "datasets.yaml")
    os.environ["DAGSTER_HOME"] = str(home / "dagster_home")
    (home / "dagster_home").mkdir(parents=True, exist_ok=True)
    import dagster as dg

    from mm_assets.clients.serve_args import extraction_args
    from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer
    from mm_assets.definitions import defs
    from mm_assets.demo.__main__ import build
    from mm_assets.domain.model.hidden_states import default_layer_ids

    demo = build()
    prep = [
        "raw_dataset",
        "coco_image_availability",
        "normalized_conversations",
        "tokenized_samples",
    ]
    for partition in PARTITIONS:
        dg.materialize(
            [defs.get_assets_def(a) for a in prep],
            partition_key=partition,
            resources=defs.resources,
            instance=dg.DagsterInstance.ephemeral(),
        )
    rows = _rows(home)
    tokens = sum(len(r["input_ids"]) for r in rows)
    server = ManagedVllmServer(
        str(demo / "target"),
        extraction_args(default_layer_ids(8), home / "blobs" / "incoming" / "bench", "auto"),
        home / "bench" / "coco",
        home / "vllm.log",
        EngineOptions(dtype="float32", kv_cache_gib=2.0),
    )
    with server as base_url:
        key = server.access.api_key
        asyncio.run(_bare_loop(base_url, key, rows[:40]))  # warm-up, both sides: first-call
        _asset_run(home, base_url, key, attempt=-1)  # costs (imports, instance) are not throughput
        bare, asset = [], []
        for attempt in range(2):
            bare.append(asyncio.run(_bare_loop(base_url, key, rows)))
            seconds, metadata = _asset_run(home, base_url, key, attempt)
            asset.append(seconds)
        rss = server.rss_bytes()
    stored_bytes = sum(m["bytes_generated"] for m in metadata.values())
    stored_tokens = sum(m["tokens_generated"] for m in metadata.values())
    raw_per_token = 4 * 64 * 4  # n_layers × H × float32 bytes
    return {
        "rows": len(rows),
        "tokens": tokens,
        "concurrency": CONCURRENCY,
        "bare_loop_tokens_per_s": [round(tokens / s) for s in bare],
        "asset_tokens_per_s": [round(tokens / s) for s in asset],
        "ratio_asset_over_bare": sum(bare) / sum(asset),
        # the request phase alone, as the asset measures it (no Dagster start-up, planning)
        "asset_request_phase_tokens_per_s": {
            p: round(m["tokens_per_s"]) for p, m in metadata.items()
        },
        "asset_step_overhead_s": round(
            asset[-1] - sum(m["tokens_generated"] / m["tokens_per_s"] for m in metadata.values()),
            2,
        ),
        "stored_bytes_per_token": stored_bytes / stored_tokens,
        "raw_bytes_per_token": raw_per_token,
        "bytes_ratio": stored_bytes / stored_tokens / raw_per_token,
        "server_startup_s": round(server.startup_seconds or 0, 1),
        "server_rss_mb": round(rss / 2**20),
        "tcmalloc_preloaded": "LD_PRELOAD" in server.environment(),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(Path(tmp)), indent=2))


if __name__ == "__main__":
    main()
