"""Intel OpenMP's spin after a parallel region (`KMP_BLOCKTIME`) on the managed CPU engine.

The managed CPU server preloads Intel OpenMP, whose threads spin 200 ms after each
parallel region by default: on a small machine they hold the cores that vLLM's API server
and the pipeline's own client need between forward passes. For each setting (the
default, 0 and 1 ms), in blocks that alternate (then reversed): a plain server generating
greedy replies (tokens/s over 48 prompts, 64 tokens each, 8 in flight) and an extraction
server serving the `hidden_states` asset (native format) on the demo's two partitions,
two rounds each. Needs a demo home (`make demo`).

`.venv/bin/python -m bench.omp_blocktime --home DEMO_HOME [--blocks 2]`
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from bench.hidden_state_storage import PARTITIONS, _copy_tables, _materialize

SETTINGS = {"default": None, "0": "0", "1": "1"}
PROMPTS = [[{"role": "user", "content": f"Tell me about item {i} of the list."}] for i in range(48)]


@contextmanager
def _blocktime(value: str | None):
    """KMP_BLOCKTIME for the servers started in the block (None: Intel's own default,
    200 ms, set explicitly, since a managed server would otherwise get 1)."""
    saved = os.environ.get("KMP_BLOCKTIME")
    os.environ["KMP_BLOCKTIME"] = value if value is not None else "200"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("KMP_BLOCKTIME", None)
        else:
            os.environ["KMP_BLOCKTIME"] = saved


def run(home: Path, blocks: int) -> dict:
    os.environ["MM_ASSETS_HOME"] = str(home)
    os.environ.setdefault("DAGSTER_HOME", str(home / "dagster_home"))
    from mm_assets.assets.resources import VllmResource
    from mm_assets.clients.serve_args import extraction_args
    from mm_assets.clients.vllm_generation import generate_greedy
    from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer
    from mm_assets.domain.model.hidden_states import default_layer_ids

    scratch = Path(tempfile.mkdtemp(prefix="mm_assets_blocktime_"))
    root, warmup = scratch / "root", scratch / "warmup"
    _copy_tables(home, root)
    _copy_tables(home, warmup)
    options = EngineOptions(dtype="float32", kv_cache_gib=2.0)
    target, images = str(home / "demo" / "target"), home / "demo" / "coco"
    generation: dict[str, list[float]] = {s: [] for s in SETTINGS}
    extraction: dict[str, dict[str, list[float]]] = {
        s: {p: [] for p in PARTITIONS} for s in SETTINGS
    }
    for block in range(blocks):
        order = list(SETTINGS) if block % 2 == 0 else list(SETTINGS)[::-1]
        for name in order:
            with _blocktime(SETTINGS[name]):
                plain = ManagedVllmServer(target, [], images, scratch / "plain.log", options)
                with plain as url:
                    generate_greedy(url, plain.access, PROMPTS[:8], 64, 8)  # warm-up
                    started = time.perf_counter()
                    replies = generate_greedy(url, plain.access, PROMPTS, 64, 8)
                    seconds = time.perf_counter() - started
                    generation[name].append(sum(map(len, replies)) / seconds)
                args = extraction_args(default_layer_ids(8), scratch / "incoming", "auto")
                server = ManagedVllmServer(target, args, images, scratch / "ext.log", options)
                with server as url:
                    fleet = VllmResource(
                        base_urls=[url],
                        api_key=server.access.api_key,
                        connector_dir=str(scratch / "incoming"),
                    )
                    for partition in PARTITIONS:
                        _materialize("hidden_states", partition, warmup, fleet, {})
                    for _ in range(2):
                        shutil.rmtree(root / "blobs", ignore_errors=True)
                        for partition in PARTITIONS:
                            meta = _materialize(
                                "hidden_states", partition, root, fleet, {"concurrency": 8}
                            )
                            extraction[name][partition].append(meta["tokens_per_s"])
    shutil.rmtree(scratch, ignore_errors=True)
    medians = {
        name: {
            "generation_tokens_per_s": statistics.median(generation[name]),
            **{p: statistics.median(extraction[name][p]) for p in PARTITIONS},
        }
        for name in SETTINGS
    }
    base = medians["default"]
    return {
        "blocks": blocks,
        "generation_tokens_per_s": generation,
        "extraction_tokens_per_s": extraction,
        "vs_default": {
            name: {k: round(v / base[k], 3) for k, v in figures.items()}
            for name, figures in medians.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=Path(".mm_assets"))
    parser.add_argument("--blocks", type=int, default=2)
    args = parser.parse_args()
    home = args.home.resolve()
    if not (home / "tables" / "tokenized_samples").is_dir():
        raise SystemExit(f"{home} holds no demo run: run `make demo` first (or pass --home)")
    print(json.dumps(run(home, args.blocks), indent=2))


if __name__ == "__main__":
    main()
