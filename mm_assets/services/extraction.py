"""Hidden states for a partition's tokenized rows: plan against the cache (rows whose blob
exists are skipped), request from vLLM, verify, store, and write the manifest. Every
response is checked (vLLM's prompt token ids must equal the stored `input_ids`) and
every file validated before it is renamed into the blob store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mm_assets.clients.connector_files import ConnectorDir, ConnectorFile, OutsideConnectorDir
from mm_assets.clients.vllm_client import ExtractionRequest, ExtractionResponse, HiddenStatesClient
from mm_assets.domain.model.hidden_state_checks import (
    HiddenStatesProblem,
    HiddenStatesRejected,
    check_prompt_ids,
    validate_tensors,
)
from mm_assets.domain.model.hidden_state_codec import encode, stored_error
from mm_assets.domain.model.hidden_state_plan import (
    Plan,
    StoredTotals,
    manifest_rows,
    plan_extraction,
)
from mm_assets.domain.model.hidden_states import ExtractionSettings, HiddenStatesLayout, human_bytes
from mm_assets.domain.prep.conversations import image_urls
from mm_assets.domain.prep.tokenization import collapse_image_tokens
from mm_assets.services.engine import Serving, VllmEngine
from mm_assets.services.request_stage import (
    ASK_AGAIN,
    Outcome,
    RequestReport,
    Stored,
    Unusable,
    run_stage,
)
from mm_assets.services.target import TargetModel
from mm_assets.storage import TableStore, WrittenTable, schemas
from mm_assets.storage.blobs import BlobStore

logger = logging.getLogger(__name__)
TOKENIZED = "tokenized_samples"
LOCK_TIMEOUT_S = 120.0
FILE_RETRIES = 2  # a server can die before its connector wrote the file: ask another


class DiskBudgetError(RuntimeError):
    """The hidden states to request cannot fit on the disk that would store them."""


def extraction_request(row: dict, image_token_id: int | None) -> ExtractionRequest:
    """A tokenized row's request; a row with images carries their URLs (from its
    `messages`) and its ids with the placeholder runs collapsed."""
    ids = list(row["input_ids"])
    urls = tuple(image_urls(json.loads(row["messages"]))) if row["messages"] else ()
    prompt = None
    if urls:
        if image_token_id is None:
            raise ValueError(
                f"row {row['row_id']} has images but the target's config names no image "
                "token (image_token_id / image_token_index); is it a vision-language model?"
            )
        prompt = collapse_image_tokens(ids, image_token_id)
    return ExtractionRequest(row["row_id"], ids, urls, prompt)


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


@dataclass(frozen=True)
class StatesFetch:
    """One row's request, and where its states go: `key` in `blobs`, encoded with the
    row's loss `mask` (compact formats; None for native ones)."""

    request: ExtractionRequest
    key: str
    blobs: BlobStore
    mask: list[int] | None


def store_response(
    fetch: StatesFetch,
    response: ExtractionResponse,
    layout: HiddenStatesLayout,
    connector: ConnectorDir,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> Path:
    """Verify one response and its file (states as `layout` says; only from `connector`'s
    directory, else rejected untouched), then move the file into the blob store — in
    another storage format, encoded once here, with its decoding error recorded."""
    try:
        check_prompt_ids(response.prompt_token_ids, fetch.request.input_ids)
        with connector.open(response.hidden_states_path, lock_timeout_s) as file:
            return _store_file(fetch, file, layout)
    except OutsideConnectorDir as exc:
        raise HiddenStatesRejected(HiddenStatesProblem.PATH_OUTSIDE, str(exc)) from exc
    finally:
        connector.discard(response.hidden_states_path)


def _store_file(fetch: StatesFetch, file: ConnectorFile, layout: HiddenStatesLayout) -> Path:
    """Store the opened, checked file: read through its descriptor, moved by name only
    when the name still is that file (and checked again once moved)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    request, key, blobs, loss_mask = fetch.request, fetch.key, fetch.blobs, fetch.mask
    try:
        tensors = load_file(file.read_path)
    except SafetensorError as exc:  # cut short or not safetensors: unreadable, asked again
        raise ValueError(f"{file.path}: {exc}") from exc
    hidden = validate_tensors(
        tensors, request.input_ids, len(layout.layer_ids), layout.hidden_size, layout.dtype
    )
    token_ids = tensors["token_ids"][: hidden.shape[0]]
    if not layout.storage.is_native:
        if loss_mask is None:
            raise ValueError(f"{layout.storage.name} needs the row's loss mask")
        encoded, metadata = encode(hidden, token_ids, layout.storage, loss_mask)
        return blobs.put_tensors(encoded, key, metadata)
    if hidden.shape[0] != tensors["hidden_states"].shape[0]:
        # an untruncated render: keep the row's prefix only
        return blobs.put_tensors({"hidden_states": hidden, "token_ids": token_ids}, key)
    if not file.is_same(file.path):
        raise OutsideConnectorDir(f"{file.path} was replaced while it was read")

    def verify(moved: Path) -> None:  # replaced between the check and the rename
        if not file.moved_to(moved):
            raise OutsideConnectorDir(f"{file.path} was replaced while it was moved")

    return blobs.put_file(file.path, key, verify, copy_from=file.read_path)


def stored_blobs(blobs: BlobStore, layout: HiddenStatesLayout) -> Callable[[str], dict | None]:
    """What the manifest records of a key the blob store holds (None: not stored)."""

    def stored(key: str) -> dict | None:
        path = blobs.path(key)
        if not path.is_file():
            return None
        error = [0.0] * 4 if layout.storage.is_native else stored_error(path)
        return {
            "path": blobs.stored_path(key),
            "bytes": path.stat().st_size,
            "max_rel_error": error,
        }

    return stored


@dataclass
class HiddenStatesJob:
    """Hidden states for `StatesFetch` items: each answer's file verified and stored as
    it arrives (`store_outcome`); a file that cannot be read is asked for again."""

    layout: HiddenStatesLayout
    connector: ConnectorDir | None = None  # online: set when the servers start
    what: str = "hidden states"
    kept: str = "Samples stored so far are kept"
    ask_again = FILE_RETRIES
    workers_per_slot = 1

    async def ask(self, client: HiddenStatesClient, item: StatesFetch) -> ExtractionResponse:
        return await client.extract(item.request)

    def write(
        self, item: StatesFetch, answer: ExtractionResponse | Exception, final: bool
    ) -> Outcome:
        assert self.connector is not None
        return store_outcome(item, answer, final, self.layout, self.connector)


def store_outcome(
    fetch: StatesFetch,
    answer: ExtractionResponse | Exception,
    final: bool,
    layout: HiddenStatesLayout,
    connector: ConnectorDir,
) -> Outcome:
    """Store one response (`store_response`), or say why its row is rejected;
    `ASK_AGAIN` when its file could not be read (unless `final`)."""
    request = fetch.request
    if isinstance(answer, Exception):
        return Unusable(request.row_id, "request_refused", str(answer))
    try:
        path = store_response(fetch, answer, layout, connector)
    except HiddenStatesRejected as exc:
        return Unusable(request.row_id, exc.reason.value, exc.detail)
    except (OSError, TimeoutError, ValueError) as exc:
        if not final:
            return ASK_AGAIN
        return Unusable(
            request.row_id,
            "bad_file",
            f"{exc} (after {FILE_RETRIES + 1} requests; for external servers: is the "
            "directory their connector writes to visible here, as connector_dir, with "
            "server_path_prefix → local_path_prefix where mounted elsewhere?)",
        )
    return Stored(request.num_tokens, os.path.getsize(path))


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Checking and encoding a row are small tensor operations; torch's intra-op thread
    pool only competes with a local vLLM server for its cores (BENCHMARKS.md, storage).
    Process-wide while the requests run: the step does nothing else."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def hidden_states_layout(
    target: TargetModel, engine: VllmEngine, settings: ExtractionSettings
) -> HiddenStatesLayout:
    """The layout of `target`'s states as `engine` serves them with `settings`."""
    facts = target.facts
    dtype = engine.for_target(facts).options.dtype
    return HiddenStatesLayout(
        target.fingerprint,
        target.layer_ids(settings.layer_ids),
        facts.hidden_size,
        dtype,
        settings.storage,
    )


@dataclass
class ExtractionReport:
    """What a hidden-states run did for a partition, for the asset to render."""

    layout: HiddenStatesLayout
    plan: Plan
    server: str
    blobs_dir: Path
    requests: RequestReport = field(default_factory=RequestReport)
    manifest: WrittenTable | None = None
    stored: StoredTotals = field(default_factory=StoredTotals)


@dataclass(frozen=True)
class PartitionExtraction:
    """Hidden states for every tokenized row of a partition that has none stored yet,
    then its manifest (`hidden_states_manifest`) and rejections tables."""

    partition: str
    tables: TableStore
    blobs: BlobStore
    target: TargetModel
    serving: Serving
    settings: ExtractionSettings

    def layout(self) -> HiddenStatesLayout:
        """What the states are (target, layer ids checked against it, dtype, storage
        format): part of every blob's key."""
        return hidden_states_layout(self.target, self.serving.engine, self.settings)

    def run(self) -> ExtractionReport:
        engine = self.serving.engine
        layout = self.layout()
        columns = ["row_id", "sample_id", "input_ids", "image_hashes", "loss_mask"]
        rows = self.tables.iter_rows(TOKENIZED, self.partition, columns)
        plan = plan_extraction(rows, layout, self.blobs.has)
        needed = check_disk_budget(plan, layout, self.blobs)
        logger.info(
            "%d rows: %d cached, %d to request (%d tokens, ~%s)",
            len(plan.rows),
            plan.cache_hits,
            len(plan.missing),
            plan.missing_tokens,
            human_bytes(needed),
        )
        report = ExtractionReport(layout, plan, engine.describe(), self.blobs.dir)
        if plan.missing:
            report.requests = self._request_missing(engine, plan, layout)
        rejected = {r["row_id"] for r in report.requests.rejections}
        listed = manifest_rows(plan, rejected, layout, stored_blobs(self.blobs, layout))
        report.manifest = self.tables.write(
            "hidden_states_manifest", self.partition, report.stored.count(listed), schemas.MANIFEST
        )
        self.tables.write(
            "hidden_states_rejections",
            self.partition,
            report.requests.rejections,
            schemas.REJECTIONS,
        )
        return report

    def _request_missing(
        self, engine: VllmEngine, plan: Plan, layout: HiddenStatesLayout
    ) -> RequestReport:
        """Start (or reach) the servers and run the plan's missing rows through them."""
        incoming = self.blobs.incoming_dir()
        connector = engine.connector_files(incoming)
        session = self.serving.extraction_session(layout.layer_ids, incoming)
        rows = self.tables.iter_rows(
            TOKENIZED, self.partition, ["row_id", "input_ids", "messages", "loss_mask"]
        )
        keys, token = plan.keys(), self.target.facts.image_token_id
        fetches = (
            StatesFetch(
                extraction_request(row, token),
                keys[row["row_id"]],
                self.blobs,
                None if layout.storage.is_native else row["loss_mask"],
            )
            for row in rows
            if row["row_id"] in plan.missing
        )
        job, client = HiddenStatesJob(layout, connector), HiddenStatesClient
        with _one_torch_thread():
            report = run_stage(session, self.settings, client, job, fetches, len(plan.missing))
        remove_if_empty(incoming)
        return report


def remove_if_empty(directory: Path) -> None:
    if directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
