"""One shape for "this row cannot be used": a reason code for counting and a detail for
the person reading the quarantine table."""

from __future__ import annotations

from enum import StrEnum


class RowRejected(Exception):
    def __init__(self, reason: StrEnum, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
