"""Generating hidden states for tokenized rows: plan against the cache, request from vLLM,
verify, store.

Planning streams the rows once to compute each row's content key; rows whose blob exists
are cache hits and cost no request (so a rerun, a reordering or an edit of other rows
sends nothing for unchanged samples, and an interrupted run resumes where it stopped).
Every response is checked — vLLM's prompt token ids must equal the stored `input_ids` —
and every file is validated before it is renamed into the blob store.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file

from mm_assets.clients.vllm_client import (
    CircuitOpen,
    ExtractionRequest,
    ExtractionResponse,
    HiddenStatesClient,
)
from mm_assets.domain.hidden_states import (
    LAYER_CONVENTION,
    HiddenStatesRejected,
    cache_key,
    check_prompt_ids,
    estimate_bytes,
    human_bytes,
    validate_tensors,
)
from mm_assets.storage.blobs import BlobStore


@dataclass(frozen=True)
class ExtractionSettings:
    target_fingerprint: str
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    lock_timeout_s: float = 120.0

    def key(self, input_ids: list[int], image_hashes: list[str]) -> str:
        return cache_key(
            self.target_fingerprint, self.layer_ids, self.dtype, input_ids, image_hashes
        )

    def estimate(self, tokens: int) -> int:
        return estimate_bytes(tokens, len(self.layer_ids), self.hidden_size, self.dtype)


@dataclass(frozen=True)
class PlannedRow:
    row_id: str
    sample_id: str
    key: str
    num_tokens: int


@dataclass
class Plan:
    rows: list[PlannedRow]
    missing: set[str]  # row ids without a blob

    @property
    def missing_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows if r.row_id in self.missing)

    @property
    def cache_hits(self) -> int:
        return len(self.rows) - len(self.missing)


def plan_extraction(rows: Iterable[dict], settings: ExtractionSettings, blobs: BlobStore) -> Plan:
    """Each row's key, and which rows have no stored hidden states yet."""
    planned, missing = [], set()
    seen_keys: set[str] = set()
    for row in rows:
        key = settings.key(row["input_ids"], row["image_hashes"] or [])
        planned.append(PlannedRow(row["row_id"], row["sample_id"], key, len(row["input_ids"])))
        if not blobs.has(key) and key not in seen_keys:
            missing.add(row["row_id"])
        seen_keys.add(key)  # identical rows share one blob and one request
    return Plan(planned, missing)


def manifest_rows(
    plan: Plan, rejected: set[str], settings: ExtractionSettings, blobs: BlobStore
) -> Iterator[dict]:
    """One row per stored sample: its blob and how it was made (checked by training)."""
    for row in plan.rows:
        path = blobs.path(row.key)
        if row.row_id in rejected or not path.is_file():
            continue
        yield {
            "row_id": row.row_id,
            "sample_id": row.sample_id,
            "blob_key": row.key,
            "path": str(path),
            "num_tokens": row.num_tokens,
            "bytes": path.stat().st_size,
            "layer_ids": settings.layer_ids,
            "layer_convention": LAYER_CONVENTION,
            "dtype": settings.dtype,
            "hidden_size": settings.hidden_size,
            "target_fingerprint": settings.target_fingerprint,
        }


def requests_for(rows: Iterable[dict], missing: set[str]) -> Iterator[ExtractionRequest]:
    for row in rows:
        if row["row_id"] in missing:
            messages = json.loads(row["messages"]) if row["messages"] else None
            yield ExtractionRequest(row["row_id"], list(row["input_ids"]), messages)


class DiskBudgetError(RuntimeError):
    pass


def check_disk_budget(plan: Plan, settings: ExtractionSettings, blobs: BlobStore) -> int:
    """Refuse to start when the missing samples cannot fit on the blob store's disk."""
    needed = settings.estimate(plan.missing_tokens) if plan.missing else 0
    free = blobs.free_bytes()
    if needed > free * 0.95:
        raise DiskBudgetError(
            f"hidden states for {len(plan.missing)} samples ({plan.missing_tokens} tokens × "
            f"{len(settings.layer_ids)} layers × {settings.hidden_size} × {settings.dtype}) "
            f"need ~{human_bytes(needed)} but {blobs.dir} has {human_bytes(free)} free; "
            "free space, point MM_ASSETS_HOME at a larger disk, or lower max_samples"
        )
    return needed


def wait_for_writer(path: Path, timeout_s: float) -> None:
    """Block until the connector released its exclusive lock on `<path>.lock`."""
    lock = Path(f"{path}.lock")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(lock) as fh:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
        except FileNotFoundError:
            if path.is_file():
                break
        except BlockingIOError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} still locked by the writer after {timeout_s:.0f}s")
        time.sleep(0.01)


def _discard(path: Path) -> None:
    path.unlink(missing_ok=True)
    Path(f"{path}.lock").unlink(missing_ok=True)


@dataclass
class ExtractionReport:
    stored: int = 0
    stored_tokens: int = 0
    stored_bytes: int = 0
    rejections: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def store_response(
    request: ExtractionRequest,
    response: ExtractionResponse,
    key: str,
    settings: ExtractionSettings,
    blobs: BlobStore,
    path_map: Callable[[str], str] = lambda p: p,
) -> Path:
    """Verify one response and its file, then move the file into the blob store."""
    source = Path(path_map(response.hidden_states_path))
    try:
        check_prompt_ids(response.prompt_token_ids, request.input_ids)
        wait_for_writer(source, settings.lock_timeout_s)
        tensors = load_file(str(source))
        hidden = validate_tensors(
            tensors,
            request.input_ids,
            len(settings.layer_ids),
            settings.hidden_size,
            settings.dtype,
        )
        if hidden.shape[0] == tensors["hidden_states"].shape[0]:
            stored = blobs.put_file(source, key)
        else:  # an untruncated render: keep the row's prefix only
            stored = blobs.put_tensors(
                {"hidden_states": hidden, "token_ids": tensors["token_ids"][: hidden.shape[0]]}, key
            )
    finally:
        _discard(source)
    return stored


def run_extraction(
    client: HiddenStatesClient,
    requests: Iterable[ExtractionRequest],
    plan: Plan,
    settings: ExtractionSettings,
    blobs: BlobStore,
    progress: Callable[[ExtractionReport, int, int], None] = lambda report, done, total: None,
    progress_every_s: float = 10.0,
    path_map: Callable[[str], str] = lambda p: p,
) -> ExtractionReport:
    """Send the missing rows and store what comes back; per-sample problems are
    collected as rejections, a dead server raises `CircuitOpen`."""
    keys = {r.row_id: r.key for r in plan.rows}
    total = len(plan.missing)
    report = ExtractionReport()
    started = time.perf_counter()
    last = [started]

    async def handle(request: ExtractionRequest, outcome: ExtractionResponse | Exception) -> None:
        if isinstance(outcome, Exception):
            report.rejections.append(
                {"row_id": request.row_id, "reason": "request_refused", "detail": str(outcome)}
            )
        else:
            try:
                path = await asyncio.get_running_loop().run_in_executor(
                    storers,
                    store_response,
                    request,
                    outcome,
                    keys[request.row_id],
                    settings,
                    blobs,
                    path_map,
                )
            except HiddenStatesRejected as exc:
                report.rejections.append(
                    {"row_id": request.row_id, "reason": exc.reason.value, "detail": exc.detail}
                )
            except (OSError, TimeoutError, ValueError) as exc:
                report.rejections.append(
                    {"row_id": request.row_id, "reason": "bad_file", "detail": str(exc)}
                )
            else:
                report.stored += 1
                report.stored_tokens += request.num_tokens
                report.stored_bytes += os.path.getsize(path)
        now = time.perf_counter()
        if now - last[0] >= progress_every_s:
            last[0] = now
            report.seconds = now - started
            progress(report, report.stored + len(report.rejections), total)

    async def main() -> None:
        try:
            await client.run(requests, handle)
        except* CircuitOpen as group:
            raise group.exceptions[0] from None
        finally:
            await client.close()

    # Storing mostly waits for the server's writer to release its lock: enough threads
    # that this waiting never holds back the next requests.
    with ThreadPoolExecutor(max_workers=4 * client.concurrency) as storers:
        asyncio.run(main())
    report.seconds = time.perf_counter() - started
    return report
