"""Blocking checks every stage shares: a partition that comes out empty (or mostly
quarantined) stops the run at the stage where it happened, with what to do about it,
instead of surfacing hours later as a training step with nothing to read."""

from __future__ import annotations

from typing import TYPE_CHECKING

import dagster as dg

from mm_assets.assets.metadata import rounded

if TYPE_CHECKING:
    from mm_assets.services.prep import StageReport

HAS_ROWS = "has_rows"
QUARANTINE_RATIO = "quarantine_ratio"


def has_rows_spec(asset: str, when_empty: str) -> dg.AssetCheckSpec:
    return dg.AssetCheckSpec(
        HAS_ROWS,
        asset=asset,
        blocking=True,
        description=f"Fails when the partition has no rows, so nothing downstream runs on "
        f"an empty table. If it fails: {when_empty}",
    )


def has_rows(rows: int, when_empty: str) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name=HAS_ROWS,
        passed=rows > 0,
        description=f"{rows:,} rows." if rows else f"The partition is empty. {when_empty}",
        metadata={"rows": rows},
    )


def quarantine_ratio_spec(asset: str, setting: str) -> dg.AssetCheckSpec:
    return dg.AssetCheckSpec(
        QUARANTINE_RATIO,
        asset=asset,
        blocking=True,
        description=f"Fails when no row is kept, or when more of the conversations than "
        f"`{setting}` allows are quarantined: that many usually means a setup problem, "
        f"not bad data. If it fails: read the reasons in the quarantine table, fix the "
        f"setup (or the data), or raise `{setting}`.",
    )


def quarantine_ratio(
    report: StageReport, conversations: int, max_ratio: float
) -> dg.AssetCheckResult:
    """Passes when some row is kept and at most `max_ratio` of the conversations are
    quarantined."""
    assert report.kept is not None and report.quarantine is not None
    kept, quarantined, reasons = report.kept.num_rows, report.quarantine.num_rows, report.reasons
    ratio = quarantined / max(conversations, 1)
    listed = ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
    description = (
        f"{quarantined:,}/{conversations:,} conversations quarantined ({ratio:.2%}); allowed "
        f"{max_ratio:.2%}. Reasons: {listed or 'none'}."
    )
    if not kept:
        description = f"No row kept. {description}"
    return dg.AssetCheckResult(
        check_name=QUARANTINE_RATIO,
        passed=bool(kept) and ratio <= max_ratio,
        description=description,
        metadata=rounded({"quarantine_ratio": ratio, "kept_rows": kept, **dict(reasons)}),
    )
