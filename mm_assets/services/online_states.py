"""Hidden states fetched from vLLM while the draft trains (`hidden_states: online`): what
a training run fetches (`OnlineStates`) and what fetching took (`FetchReport`). The
fetching itself is `services/online_batches.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from mm_assets.clients.vllm_client import ExtractionRequest
from mm_assets.domain.model.hidden_state_plan import plan_extraction
from mm_assets.domain.model.hidden_states import ExtractionSettings, HiddenStatesLayout
from mm_assets.domain.model.settings import OnlineSettings
from mm_assets.domain.model.training_data import SampleRef
from mm_assets.services.engine import Serving
from mm_assets.services.extraction import (
    check_disk_budget,
    extraction_request,
    hidden_states_layout,
)
from mm_assets.services.request_stage import RequestReport
from mm_assets.services.target import TargetModel
from mm_assets.storage.blobs import BlobStore


@dataclass
class PassReport:
    """One pass over batches (an epoch, a held-out evaluation) as the fetch side saw it."""

    label: str
    rows: int = 0
    cache_hits: int = 0  # rows whose states were stored already (nothing requested)
    fetched: int = 0
    fetched_tokens: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    trainer_wait_s: float = 0.0  # the trainer waiting for states
    request_wait_s: float = 0.0  # requests waiting for the trainer (the window full)
    seconds: float = 0.0

    def line(self) -> str:
        rejected = ", ".join(f"{n} {reason}" for reason, n in self.rejected.items()) or "none"
        return (
            f"{self.label}: {self.rows} rows, {self.fetched} fetched ({self.fetched_tokens} "
            f"tokens), {self.cache_hits} stored already, rejected: {rejected}; the trainer "
            f"waited {self.trainer_wait_s:.1f}s for states, requests waited "
            f"{self.request_wait_s:.1f}s for the trainer ({self.seconds:.1f}s)"
        )


@dataclass
class FetchReport:
    """Every pass of a training run, the requests behind them, and the disk they took."""

    cache: str
    passes: list[PassReport] = field(default_factory=list)
    requests: RequestReport = field(default_factory=RequestReport)
    disk_peak_bytes: int = 0  # `discard`: the most bytes the scratch directory held at once
    largest_batch_bytes: int = 0  # the most bytes fetched for one batch


@dataclass(frozen=True)
class OnlineStates:
    """How a training run gets a partition's states online: what they are (`layout`),
    where they come from (`engine`), how requests are sent (`extraction`: the
    partition's `hidden_states` settings) and where they are stored (`blobs`)."""

    layout: HiddenStatesLayout
    extraction: ExtractionSettings
    online: OnlineSettings
    serving: Serving
    image_token_id: int | None
    blobs: BlobStore

    @classmethod
    def for_target(
        cls,
        target: TargetModel,
        serving: Serving,
        extraction: ExtractionSettings,
        online: OnlineSettings,
        blobs: BlobStore,
    ) -> OnlineStates:
        """The states `extraction` describes (its layer ids checked against the target),
        fetched through `serving` into `blobs`."""
        layout = hidden_states_layout(target, serving.engine, extraction)
        return cls(layout, extraction, online, serving, target.facts.image_token_id, blobs)

    def training_rows(
        self, rows: Sequence[dict]
    ) -> tuple[list[SampleRef], dict[str, str], dict[str, ExtractionRequest]]:
        """The tokenized `rows` as training refs (at their blob's path, stored or not),
        with each row's blob key and extraction request."""
        plan = plan_extraction(rows, self.layout, self.blobs.has)
        if self.online.online_cache == "keep":  # what is missing ends up on this disk
            check_disk_budget(plan, self.layout, self.blobs)
        keys = plan.keys()
        requests = {
            r["row_id"]: extraction_request(r, self.image_token_id)
            for r in rows
            if r["row_id"] in keys
        }
        path = {row: str(self.blobs.path(key)) for row, key in keys.items()}
        refs = [
            SampleRef(r["row_id"], path[r["row_id"]], r["input_ids"], r["loss_mask"]) for r in rows
        ]
        return refs, keys, requests
