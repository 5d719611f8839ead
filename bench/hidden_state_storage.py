"""Hidden-state storage formats: bytes, extraction and training speed, and acceptance.

On the demo's two on-policy partitions (a demo home where `make demo` has run), for the
native layout and the compact `fp8_e4m3` + `final_layer: needed`:

- bytes per token stored, against speculators' bf16 layout `n_layers x H x 2` (the
  reference is that formula, so the ratio means the same on any machine); the other
  formats' bytes come from encoding the native blobs with the same encoder;
- extraction tokens/s of the `hidden_states` asset (the request phase it reports), one
  extraction server for the whole run, formats alternating round by round, fresh blobs
  each round; and the CPU seconds each round cost the server's process tree and the
  client (this process), per 1,000 tokens: on a machine whose cores the server and
  client share, throughput goes as the inverse of their sum, and CPU seconds drift far
  less than wall-clock rates with the machine's speed;
- training tokens/s reading each format, and the acceptance of the drafts trained on
  each (same seed and settings: the demo's), estimated offline and measured by vLLM on
  the same held-out prompts.

Prints a Markdown block for BENCHMARKS.md, then the results as JSON.
`.venv/bin/python -m bench.hidden_state_storage --home DEMO_HOME [--rounds R]`
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PARTITIONS = ("demo_sharegpt4v_coco", "demo_sharegpt")
FORMATS = {
    "native": {},
    "fp8_e4m3/needed": {"storage_dtype": "fp8_e4m3", "final_layer": "needed"},
}
OTHER_FORMATS = ("bf16/all", "bf16/needed", "fp8_e4m3/all")
TABLES = ("tokenized_samples", "token_frequencies", "target_responses")
CONCURRENCY = 8


def _copy_tables(home: Path, root: Path) -> None:
    for partition in PARTITIONS:
        for table in TABLES:
            name = Path("tables") / table / f"dataset={partition}" / "data.parquet"
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(home / name, root / name)


def _materialize(asset: str, partition: str, root: Path, vllm: Any, config: dict) -> dict:
    import dagster as dg

    from mm_assets.assets.resources import StorageResource
    from mm_assets.definitions import defs

    result = dg.materialize(
        [defs.get_assets_def(asset)],
        partition_key=partition,
        resources={**defs.resources, "storage": StorageResource(root=str(root)), "vllm": vllm},
        run_config={"ops": {asset: {"config": config}}},
        instance=dg.DagsterInstance.ephemeral(),
    )
    (mat,) = result.asset_materializations_for_node(asset)
    return {k: v.value for k, v in mat.metadata.items()}


def _at_real_width(root: Path, partition: str, hidden_size: int = 3584) -> dict[str, float]:
    """The formats' bytes over the bf16 layout for these rows at a real target's width
    (Qwen2.5-VL-7B: H=3584), computed from the rows' token and supervised counts."""
    from mm_assets.domain.model.hidden_state_format import FinalLayer, StorageDtype, StorageFormat
    from mm_assets.storage import TableStore

    rows = list(TableStore(root).iter_rows("tokenized_samples", partition))
    tokens, supervised = sum(r["seq_len"] for r in rows), sum(r["num_supervised"] for r in rows)
    reference = tokens * 4 * hidden_size * 2
    out = {}
    for name in ("fp8_e4m3/needed", *OTHER_FORMATS):
        dtype, final = name.split("/")
        fmt = StorageFormat(StorageDtype(dtype), FinalLayer(final))
        out[name] = round(
            fmt.estimate_bytes(tokens, supervised, hidden_size, "bfloat16") / reference, 4
        )
    return {"supervised_share": round(supervised / tokens, 3), **out}


def _encoded_bytes(root: Path, partition: str, hidden_size: int) -> dict[str, float]:
    """Bytes/token over the bf16 layout for the other formats, from the native blobs."""
    from safetensors.torch import load_file, save

    from mm_assets.domain.model.hidden_state_codec import encode
    from mm_assets.domain.model.hidden_state_format import FinalLayer, StorageDtype, StorageFormat
    from mm_assets.storage import TableStore

    tables = TableStore(root)
    masks = {r["row_id"]: r["loss_mask"] for r in tables.iter_rows("tokenized_samples", partition)}
    totals = dict.fromkeys(OTHER_FORMATS, 0)
    tokens = 0
    for row in tables.iter_rows("hidden_states_manifest", partition):
        native = load_file(tables.resolve(row["path"]))
        tokens += row["num_tokens"]
        for name in OTHER_FORMATS:
            dtype, final = name.split("/")
            fmt = StorageFormat(StorageDtype(dtype), FinalLayer(final))
            tensors, metadata = encode(
                native["hidden_states"], native["token_ids"], fmt, masks[row["row_id"]]
            )
            totals[name] += len(save(tensors, {**metadata, "max_rel_error": "[0,0,0,0]"}))
    return {name: total / (tokens * 4 * hidden_size * 2) for name, total in totals.items()}


def client_cost_at_real_width(tokens: int = 1000, hidden_size: int = 3584, rows: int = 6) -> dict:
    """CPU seconds the extraction client spends per 1,000 tokens storing a row at a real
    width (bf16, as a GPU target serves), through `store_response` on one torch thread:
    native (check, then rename) against fp8_e4m3 / needed (check, encode, write). On a
    GPU server this work is what the client's cores must keep up with; on this machine
    it also takes cores from the local CPU engine."""
    import time
    from dataclasses import dataclass

    import torch
    from safetensors.torch import save_file

    from mm_assets.clients.connector_files import ConnectorDir
    from mm_assets.domain.model.hidden_state_format import FinalLayer, StorageDtype, StorageFormat
    from mm_assets.domain.model.hidden_states import HiddenStatesLayout
    from mm_assets.services.extraction import StatesFetch, store_response
    from mm_assets.storage.blobs import BlobStore

    @dataclass
    class Request:
        input_ids: list[int]

    @dataclass
    class Response:
        hidden_states_path: str
        prompt_token_ids: list[int]

    torch.set_num_threads(1)
    ids = list(range(tokens))
    mask = [0] * (tokens * 2 // 3) + [1] * (tokens - tokens * 2 // 3)  # a third supervised
    compact = StorageFormat(StorageDtype.FP8_E4M3, FinalLayer.NEEDED)
    formats = {"native": StorageFormat(), "fp8_e4m3/needed": compact}
    cost: dict[str, list[float]] = {name: [] for name in formats}
    with tempfile.TemporaryDirectory(prefix="mm_assets_client_cost_") as tmp:
        for i in range(rows):
            for name, fmt in formats.items():  # alternating, so drift hits both alike
                blobs = BlobStore(Path(tmp) / name.replace("/", "_"))
                layout = HiddenStatesLayout("t", [2, 16, 25, 28], hidden_size, "bfloat16", fmt)
                source = blobs.incoming_dir() / "row.safetensors"
                hidden = torch.randn(tokens, 4, hidden_size).to(torch.bfloat16)
                save_file({"hidden_states": hidden, "token_ids": torch.tensor(ids)}, str(source))
                started = time.process_time()
                fetch = StatesFetch(Request(ids), f"{i:02d}{name[:2]}", blobs, mask)
                store_response(
                    fetch, Response(str(source), ids), layout, ConnectorDir(source.parent)
                )
                cost[name].append((time.process_time() - started) * 1e6 / tokens)
    return {name: round(statistics.median(c), 1) for name, c in cost.items()}


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children so far."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _training_figures(meta: dict) -> dict:
    keys = (
        "train_tokens_per_s", "acceptance_length_estimate", "vllm_acceptance_length",
        "vllm_acceptance_length_estimate", "vllm_prompts",
    )  # fmt: skip
    return {k: meta.get(k, float("nan")) for k in keys}


def run(home: Path, rounds: int, train: bool = True) -> dict:
    os.environ["MM_ASSETS_HOME"] = str(home)
    os.environ.setdefault("DAGSTER_HOME", str(home / "dagster_home"))
    from mm_assets.assets.resources import VllmResource
    from mm_assets.clients.serve_args import extraction_args
    from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer
    from mm_assets.domain.model.hidden_states import default_layer_ids

    client_cost = client_cost_at_real_width()  # before the server takes the cores
    scratch = Path(tempfile.mkdtemp(prefix="mm_assets_storage_bench_"))
    roots = {name: scratch / name.replace("/", "_") for name in FORMATS}
    for root in [*roots.values(), scratch / "warmup"]:
        _copy_tables(home, root)
    extraction: dict[str, dict[str, list]] = {f: {p: [] for p in PARTITIONS} for f in FORMATS}
    cpu: dict[str, dict[str, list]] = {f: {p: [] for p in PARTITIONS} for f in FORMATS}
    metadata: dict[str, dict[str, dict]] = {f: {} for f in FORMATS}
    server = ManagedVllmServer(
        str(home / "demo" / "target"),
        extraction_args(default_layer_ids(8), scratch / "incoming", "auto"),
        home / "demo" / "coco",
        scratch / "vllm.log",
        EngineOptions(dtype="float32", kv_cache_gib=2.0),
    )
    with server as base_url:
        external = VllmResource(
            base_urls=[base_url],
            api_key=server.access.api_key,
            connector_dir=str(scratch / "incoming"),
        )
        for partition in PARTITIONS:  # warm-up: first-call costs are not throughput
            _materialize("hidden_states", partition, scratch / "warmup", external, {})
        for _ in range(rounds):
            for name, storage in FORMATS.items():
                shutil.rmtree(roots[name] / "blobs", ignore_errors=True)
                for partition in PARTITIONS:
                    config = {**storage, "concurrency": CONCURRENCY}
                    assert server.process is not None
                    before = (_tree_cpu_s(server.process.pid), time.process_time())
                    meta = _materialize("hidden_states", partition, roots[name], external, config)
                    spent = (_tree_cpu_s(server.process.pid), time.process_time())
                    per_1k = 1000 / meta["tokens_generated"]
                    cpu[name][partition].append(
                        [(b - a) * per_1k * 1000 for a, b in zip(before, spent, strict=True)]
                    )  # [server, client] ms per 1,000 tokens
                    extraction[name][partition].append(meta["tokens_per_s"])
                    metadata[name][partition] = meta
    trained: dict[str, dict[str, dict]] = {f: {} for f in FORMATS}
    managed = VllmResource(dtype="float32")
    for name in FORMATS if train else ():
        for partition in PARTITIONS:
            # the demo's training settings come from its registry entries
            config = {"measure_untrained_in_vllm": False, "retrain": True}
            trained[name][partition] = _materialize(
                "trained_speculator", partition, roots[name], managed, config
            )
    results: dict[str, Any] = {
        "rounds": rounds, "concurrency": CONCURRENCY, "partitions": {},
        "client_cpu_ms_per_1k_tokens_at_H3584": client_cost,
    }  # fmt: skip
    for partition in PARTITIONS:
        native, compact = (metadata[f][partition] for f in FORMATS)
        speed = {f: statistics.median(extraction[f][partition]) for f in FORMATS}
        other = _encoded_bytes(roots["native"], partition, 64)
        results["partitions"][partition] = {
            "bytes_vs_bf16_layout": {
                "native (fp32 demo)": native["bytes_vs_bf16_layout"],
                "fp8_e4m3/needed": compact["bytes_vs_bf16_layout"],
                **{k: round(v, 4) for k, v in other.items()},
            },
            "bytes_vs_bf16_layout_at_H3584": _at_real_width(roots["native"], partition),
            "max_rel_error_fp8_needed": compact["max_rel_error_per_layer"],
            "extraction_tokens_per_s": {f: extraction[f][partition] for f in FORMATS},
            "extraction_ratio": speed["fp8_e4m3/needed"] / speed["native"],
            "extraction_cpu_ms_per_1k_tokens": {
                f: {
                    "server": statistics.median(s for s, _ in cpu[f][partition]),
                    "client": statistics.median(c for _, c in cpu[f][partition]),
                }
                for f in FORMATS
            },
            "training": {f: _training_figures(trained[f].get(partition, {})) for f in FORMATS},
        }
    shutil.rmtree(scratch, ignore_errors=True)
    return results


def markdown(results: dict, command: str) -> str:
    today = datetime.date.today().isoformat()
    lines = [f"Measured {today}; `{command}`.", ""]
    lines.append("| partition | format | bytes / bf16 layout | extraction tok/s (rounds) | "
                 "train tok/s | estimate | vLLM measured |")  # fmt: skip
    lines.append("|---|---|---:|---|---:|---:|---:|")
    for partition, r in results["partitions"].items():
        for fmt in FORMATS:
            key = "native (fp32 demo)" if fmt == "native" else fmt
            t = r["training"][fmt]
            speeds = ", ".join(f"{s:,.0f}" for s in r["extraction_tokens_per_s"][fmt])
            lines.append(
                f"| `{partition}` | {fmt} | {r['bytes_vs_bf16_layout'][key]:.3f} | {speeds} | "
                f"{t['train_tokens_per_s']:,.0f} | {t['vllm_acceptance_length_estimate']:.3f} | "
                f"{t['vllm_acceptance_length']:.3f} |"
            )
        for fmt in OTHER_FORMATS:
            lines.append(
                f"| `{partition}` | {fmt} | {r['bytes_vs_bf16_layout'][fmt]:.3f} | | | | |"
            )
    lines += ["", "Extraction CPU per 1,000 tokens (medians over the rounds; server process "
              "tree + client):", ""]  # fmt: skip
    lines.append("| partition | native server + client | fp8_e4m3/needed server + client | "
                 "CPU-bound ratio | tok/s ratio of medians |")  # fmt: skip
    lines.append("|---|---:|---:|---:|---:|")
    for partition, r in results["partitions"].items():
        c = r["extraction_cpu_ms_per_1k_tokens"]
        totals = {f: c[f]["server"] + c[f]["client"] for f in FORMATS}
        lines.append(
            f"| `{partition}` | {c['native']['server']:.1f} + {c['native']['client']:.1f} | "
            f"{c['fp8_e4m3/needed']['server']:.1f} + {c['fp8_e4m3/needed']['client']:.1f} | "
            f"{totals['native'] / totals['fp8_e4m3/needed']:.2f} | {r['extraction_ratio']:.2f} |"
        )
    cost = results["client_cpu_ms_per_1k_tokens_at_H3584"]
    lines += [
        "",
        "Client CPU per 1,000 tokens stored at H=3584 (bf16 rows of 1,000 tokens, a third "
        f"supervised; one torch thread): native {cost['native']} ms, fp8_e4m3/needed "
        f"{cost['fp8_e4m3/needed']} ms.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=Path(".mm_assets"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-training", action="store_true", help="bytes and extraction only")
    args = parser.parse_args()
    home = args.home.resolve()
    if not (home / "tables" / "target_responses").is_dir():
        raise SystemExit(f"{home} holds no demo run: run `make demo` first (or pass --home)")
    results = run(home, args.rounds, train=not args.no_training)
    command = (
        f".venv/bin/python -m bench.hidden_state_storage --home {args.home} --rounds {args.rounds}"
        + (" --no-training" if args.no_training else "")
    )
    print(markdown(results, command))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
