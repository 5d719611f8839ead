"""Hidden states for a partition's tokenized rows: plan against the cache, request from
vLLM, verify, store, and write the manifest.

Planning streams the rows once to compute each row's content key; rows whose blob exists
are cache hits and cost no request (so a rerun, a reordering or an edit of other rows
sends nothing for unchanged samples, and an interrupted run resumes where it stopped).
Every response is checked — vLLM's prompt token ids must equal the stored `input_ids` —
and every file is validated before it is renamed into the blob store.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mm_assets.clients.vllm_client import (
    CircuitOpen,
    ExtractionRequest,
    ExtractionResponse,
    HiddenStatesClient,
    RequestRefused,
)
from mm_assets.common.progress import Progress
from mm_assets.domain.model.hidden_state_checks import (
    HiddenStatesRejected,
    check_prompt_ids,
    validate_tensors,
)
from mm_assets.domain.model.hidden_state_codec import encode, stored_error
from mm_assets.domain.model.hidden_states import (
    LAYER_CONVENTION,
    ExtractionSettings,
    HiddenStatesLayout,
    human_bytes,
)
from mm_assets.domain.prep.conversations import image_urls
from mm_assets.domain.prep.tokenization import collapse_image_tokens
from mm_assets.services.engine import VllmEngine
from mm_assets.services.target import TargetModel
from mm_assets.storage import TableStore, WrittenTable, schemas
from mm_assets.storage.blobs import BlobStore

TOKENIZED = "tokenized_samples"
LOCK_TIMEOUT_S = 120.0
FILE_RETRIES = 2
"""Requests again for a row whose answer came without a readable file: the server that
answered can die before its connector finished writing (the next try goes to another)."""


@dataclass(frozen=True)
class PlannedRow:
    row_id: str
    sample_id: str
    key: str
    num_tokens: int
    num_supervised: int


@dataclass
class Plan:
    rows: list[PlannedRow]
    missing: set[str]  # row ids without a blob

    @property
    def missing_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows if r.row_id in self.missing)

    @property
    def missing_supervised(self) -> int:
        return sum(r.num_supervised for r in self.rows if r.row_id in self.missing)

    @property
    def cache_hits(self) -> int:
        return len(self.rows) - len(self.missing)


def plan_extraction(rows: Iterable[dict], layout: HiddenStatesLayout, blobs: BlobStore) -> Plan:
    """Each row's key, and which rows have no stored hidden states yet."""
    planned, missing = [], set()
    seen_keys: set[str] = set()
    for row in rows:
        key = layout.key(row["input_ids"], row["image_hashes"] or [], row["loss_mask"])
        supervised = sum(row["loss_mask"])
        planned.append(
            PlannedRow(row["row_id"], row["sample_id"], key, len(row["input_ids"]), supervised)
        )
        if not blobs.has(key) and key not in seen_keys:
            missing.add(row["row_id"])
        seen_keys.add(key)  # identical rows share one blob and one request
    return Plan(planned, missing)


def manifest_rows(
    plan: Plan, rejected: set[str], layout: HiddenStatesLayout, blobs: BlobStore
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
            "path": blobs.stored_path(row.key),
            "num_tokens": row.num_tokens,
            "bytes": path.stat().st_size,
            "layer_ids": layout.layer_ids,
            "layer_convention": LAYER_CONVENTION,
            "dtype": layout.dtype,
            "hidden_size": layout.hidden_size,
            "target_fingerprint": layout.target_fingerprint,
            "storage_dtype": layout.storage.dtype.value,
            "final_layer": layout.storage.final_layer.value,
            "max_rel_error": [0.0] * 4 if layout.storage.is_native else stored_error(path),
        }


def requests_for(
    rows: Iterable[dict],
    missing: set[str],
    image_token_id: int | None,
    loss_masks: dict[str, list[int]] | None = None,
) -> Iterator[ExtractionRequest]:
    """Requests for the missing rows; a row with images carries their URLs (from its
    `messages`) and its ids with the placeholder runs collapsed. With `loss_masks`, each
    request's row mask is put there until its response is stored (compact formats)."""
    for row in rows:
        if row["row_id"] not in missing:
            continue
        if loss_masks is not None:
            loss_masks[row["row_id"]] = row["loss_mask"]
        ids = list(row["input_ids"])
        urls = tuple(image_urls(json.loads(row["messages"]))) if row["messages"] else ()
        if urls and image_token_id is None:
            raise ValueError(
                f"row {row['row_id']} has images but the target's config names no image "
                "token (image_token_id / image_token_index); is it a vision-language model?"
            )
        prompt = (
            collapse_image_tokens(ids, image_token_id)
            if urls and image_token_id is not None
            else None
        )
        yield ExtractionRequest(row["row_id"], ids, urls, prompt)


class DiskBudgetError(RuntimeError):
    pass


def check_disk_budget(plan: Plan, layout: HiddenStatesLayout, blobs: BlobStore) -> int:
    """Refuse to start when the missing samples cannot fit on the blob store's disk."""
    needed = layout.estimate(plan.missing_tokens, plan.missing_supervised, len(plan.missing))
    free = blobs.free_bytes()
    if needed > free * 0.95:
        raise DiskBudgetError(
            f"hidden states for {len(plan.missing)} samples ({plan.missing_tokens} tokens × "
            f"{len(layout.layer_ids)} layers × {layout.hidden_size} × {layout.dtype}, "
            f"stored as {layout.storage.name}) "
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


def store_response(
    request: ExtractionRequest,
    response: ExtractionResponse,
    key: str,
    layout: HiddenStatesLayout,
    blobs: BlobStore,
    path_map: Callable[[str], str] = lambda p: p,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    loss_mask: list[int] | None = None,
) -> Path:
    """Verify one response and its file, then move the file into the blob store — in
    another storage format, encoded once here, with its decoding error recorded."""
    from safetensors.torch import load_file

    source = Path(path_map(response.hidden_states_path))
    try:
        check_prompt_ids(response.prompt_token_ids, request.input_ids)
        wait_for_writer(source, lock_timeout_s)
        tensors = load_file(str(source))
        hidden = validate_tensors(
            tensors, request.input_ids, len(layout.layer_ids), layout.hidden_size, layout.dtype
        )
        token_ids = tensors["token_ids"][: hidden.shape[0]]
        if not layout.storage.is_native:
            if loss_mask is None:
                raise ValueError(f"{layout.storage.name} needs the row's loss mask")
            encoded, metadata = encode(hidden, token_ids, layout.storage, loss_mask)
            return blobs.put_tensors(encoded, key, metadata)
        if hidden.shape[0] == tensors["hidden_states"].shape[0]:
            return blobs.put_file(source, key)
        # an untruncated render: keep the row's prefix only
        return blobs.put_tensors({"hidden_states": hidden, "token_ids": token_ids}, key)
    finally:
        _discard(source)


@dataclass
class RunTally:
    """What the requests of one run produced."""

    stored: int = 0
    stored_tokens: int = 0
    stored_bytes: int = 0
    rejections: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    requests_sent: int = 0
    servers: list[dict] = field(default_factory=list)
    """Each server's answers, failed tries and tokens (`VllmClient.server_stats`)."""

    def reject(self, row_id: str, reason: str, detail: str) -> None:
        self.rejections.append({"row_id": row_id, "reason": reason, "detail": detail})


def _store_outcome(
    request: ExtractionRequest,
    outcome: ExtractionResponse | Exception,
    store: Callable[[ExtractionRequest, ExtractionResponse], Path],
    tally: RunTally,
    final: bool = True,
) -> bool:
    """Store one response, or record why its row is rejected. False when its file could
    not be read and the row is to be requested again (unless `final`)."""
    if isinstance(outcome, Exception):
        tally.reject(request.row_id, "request_refused", str(outcome))
        return True
    try:
        path = store(request, outcome)
    except HiddenStatesRejected as exc:
        tally.reject(request.row_id, exc.reason.value, exc.detail)
    except (OSError, TimeoutError, ValueError) as exc:
        if not final:
            return False
        tally.reject(
            request.row_id, "bad_file",
            f"{exc} (after {FILE_RETRIES + 1} requests; for external servers: is the "
            "directory their connector writes to visible here, at server_path_prefix → "
            "local_path_prefix?)",
        )  # fmt: skip
    else:
        tally.stored += 1
        tally.stored_tokens += request.num_tokens
        tally.stored_bytes += os.path.getsize(path)
    return True


def run_extraction(
    client: HiddenStatesClient,
    requests: Iterable[ExtractionRequest],
    plan: Plan,
    layout: HiddenStatesLayout,
    blobs: BlobStore,
    log: Callable[[str], None] = lambda line: None,
    path_map: Callable[[str], str] = lambda p: p,
    loss_masks: dict[str, list[int]] | None = None,
) -> RunTally:
    """Send the missing rows and store what comes back; per-sample problems are
    collected as rejections, a dead server raises `CircuitOpen`. `loss_masks` are the
    rows' masks as `requests_for` fills them (compact formats need them)."""
    keys = {r.row_id: r.key for r in plan.rows}
    tally = RunTally()
    progress = Progress(log, "hidden states", len(plan.missing), every_s=10.0)
    started = time.perf_counter()

    def store(request: ExtractionRequest, response: ExtractionResponse) -> Path:
        mask = loss_masks.get(request.row_id) if loss_masks is not None else None
        return store_response(
            request, response, keys[request.row_id], layout, blobs, path_map, loss_mask=mask
        )

    async def handle(request: ExtractionRequest, outcome: ExtractionResponse | Exception) -> None:
        loop = asyncio.get_running_loop()
        for attempt in range(FILE_RETRIES + 1):
            final = attempt == FILE_RETRIES
            if await loop.run_in_executor(
                storers, _store_outcome, request, outcome, store, tally, final
            ):
                break
            try:
                outcome = await client.extract(request)
            except RequestRefused as exc:
                outcome = exc
        if loss_masks is not None:
            loss_masks.pop(request.row_id, None)  # held only while its row is in flight
        rate = tally.stored_tokens / max(time.perf_counter() - started, 1e-9)
        progress.update(tally.stored + len(tally.rejections), f"{rate:,.0f} tok/s")

    async def main() -> None:
        try:
            await client.run(requests, handle)
        except* CircuitOpen as group:
            raise group.exceptions[0] from None
        finally:
            await client.close()

    # Storing mostly waits for the server's writer to release its lock: enough threads
    # that this waiting never holds back the next requests.
    with ThreadPoolExecutor(max_workers=4 * client.concurrency) as storers, _one_torch_thread():
        try:
            asyncio.run(main())
        finally:
            tally.requests_sent = client.requests_sent
            tally.servers = client.server_stats()
            tally.seconds = time.perf_counter() - started
    return tally


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Checking and encoding a row are small tensor operations; torch's intra-op thread
    pool only competes with a local vLLM server for its cores (on 2 cores, multimodal
    extraction with fp8 encoding: 0.81x native with the pool, 0.92x without, alternating
    rounds of one run). Process-wide while the requests run: the step does nothing else."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class StoredTotals:
    """Every stored row of the partition (cached or new), as the manifest lists them."""

    rows: int = 0
    tokens: int = 0
    bytes: int = 0
    max_rel_error: list[float] = field(default_factory=lambda: [0.0] * 4)

    def count(self, rows: Iterable[dict]) -> Iterator[dict]:
        for row in rows:
            self.rows += 1
            self.tokens += row["num_tokens"]
            self.bytes += row["bytes"]
            self.max_rel_error = [
                max(a, b) for a, b in zip(self.max_rel_error, row["max_rel_error"], strict=True)
            ]
            yield row

    def bf16_layout_ratio(self, hidden_size: int) -> float:
        """Stored bytes per token over speculators' bf16 layout (4 layers x H x 2 bytes)."""
        return self.bytes / max(self.tokens * 4 * hidden_size * 2, 1)


class ServerUnavailable(RuntimeError):
    """vLLM stopped answering mid-run; what was stored is kept for the rerun."""


@dataclass
class ExtractionReport:
    """What a hidden-states run did for a partition, for the asset to render."""

    layout: HiddenStatesLayout
    plan: Plan
    server: str
    blobs_dir: Path
    tally: RunTally = field(default_factory=RunTally)
    manifest: WrittenTable | None = None
    startup_s: float | None = None
    server_rss_bytes: int | None = None
    stored: StoredTotals = field(default_factory=StoredTotals)

    @property
    def rejection_ratio(self) -> float:
        return len(self.tally.rejections) / max(len(self.plan.rows), 1)

    @property
    def rejections_by_reason(self) -> Counter[str]:
        return Counter(r["reason"] for r in self.tally.rejections)


@dataclass(frozen=True)
class PartitionExtraction:
    """Hidden states for every tokenized row of a partition that has none stored yet,
    then its manifest (`hidden_states_manifest`) and rejections tables."""

    partition: str
    tables: TableStore
    blobs: BlobStore
    target: TargetModel
    engine: VllmEngine
    settings: ExtractionSettings
    image_root: Path | None
    log_path: Path
    log: Callable[[str], None] = print

    def run(self) -> ExtractionReport:
        facts = self.target.facts
        engine = self.engine.for_target(facts)
        layer_ids = self.target.layer_ids(self.settings.layer_ids)
        layout = HiddenStatesLayout(
            self.target.fingerprint, layer_ids, facts.hidden_size, engine.options.dtype,
            self.settings.storage,
        )  # fmt: skip
        columns = ["row_id", "sample_id", "input_ids", "image_hashes", "loss_mask"]
        rows = self.tables.iter_rows(TOKENIZED, self.partition, columns)
        plan = plan_extraction(rows, layout, self.blobs)
        needed = check_disk_budget(plan, layout, self.blobs)
        self.log(
            f"{len(plan.rows)} rows: {plan.cache_hits} cached, {len(plan.missing)} to "
            f"request ({plan.missing_tokens} tokens, ~{human_bytes(needed)})"
        )
        report = ExtractionReport(layout, plan, engine.describe(), self.blobs.dir)
        if plan.missing:
            self._request_missing(engine, report)
        rejected = {r["row_id"] for r in report.tally.rejections}
        manifest = report.stored.count(manifest_rows(plan, rejected, layout, self.blobs))
        report.manifest = self.tables.write(
            "hidden_states_manifest", self.partition, manifest, schemas.MANIFEST
        )
        self.tables.write(
            "hidden_states_rejections", self.partition, report.tally.rejections,
            schemas.REJECTIONS,
        )  # fmt: skip
        return report

    def _request_missing(self, engine: VllmEngine, report: ExtractionReport) -> None:
        """Start (or reach) the servers and run the plan's missing rows through them."""
        incoming = self.blobs.incoming_dir()
        model = str(self.target.local_dir)
        layer_ids = report.layout.layer_ids
        with engine.extraction_session(
            model, layer_ids, incoming, self.image_root, self.log_path
        ) as session:
            if session.managed:
                report.startup_s = session.managed.startup_seconds
                self.log(f"vLLM started in {report.startup_s:.1f}s, log {self.log_path}")
            settings = self.settings
            client = HiddenStatesClient(
                session.base_urls, settings.concurrency, settings.request_timeout_s,
                settings.max_retries, settings.breaker_failures, engine.api_key,
                probe_after_s=settings.probe_after_s, log=self.log,
            )  # fmt: skip
            columns = ["row_id", "input_ids", "messages", "loss_mask"]
            rows = self.tables.iter_rows(TOKENIZED, self.partition, columns)
            masks = None if report.layout.storage.is_native else {}
            image_token = self.target.facts.image_token_id
            requests = requests_for(rows, report.plan.missing, image_token, masks)
            try:
                report.tally = run_extraction(
                    client, requests, report.plan, report.layout, self.blobs, self.log,
                    engine.map_path, masks,
                )  # fmt: skip
            except CircuitOpen as exc:
                raise ServerUnavailable(
                    f"vLLM stopped answering: {exc}. Samples stored so far are kept; "
                    "rerun to resume."
                ) from exc
            if session.managed:
                report.server_rss_bytes = session.managed.rss_bytes()
        if not any(incoming.iterdir()):
            incoming.rmdir()
