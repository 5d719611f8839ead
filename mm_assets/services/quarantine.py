"""A stage's kept table and its quarantine: rows dropped with a reason each, counted.
Shared by the services that quarantine rows (prep, regeneration); imports no service."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from mm_assets.domain.rejection import RowRejected
from mm_assets.storage import WrittenTable
from mm_assets.storage.tables import BatchWriter


@dataclass
class StageReport:
    kept: WrittenTable | None = None
    quarantine: WrittenTable | None = None
    reasons: Counter[str] = field(default_factory=Counter)


def quarantine_row(
    out: BatchWriter,
    report: StageReport,
    source_index: int,
    sample_id: str | None,
    record: str,
    exc: RowRejected,
) -> None:
    report.reasons[exc.reason.value] += 1
    out.write(
        {
            "source_index": source_index,
            "sample_id": sample_id,
            "reason": exc.reason.value,
            "detail": exc.detail,
            "record": record,
        }
    )
