"""Removing the embedded images that nothing references any more, safely by construction.

An image taken out of a row is written once, by content, and shared by every partition
whose rows held it; a partition loaded again with other rows leaves images behind, which
`prune_embedded_images` removes (the Dagster job of that name, `apply: true`).

An image is removed only when all of these hold at the moment of its removal:
- no table that can name an embedded image names it (`IMAGE_COLUMNS`), read again right
  before each batch of removals, not once at the start;
- no load in flight references it: a load stages every image it references, a stored
  one as a hard link (`EmbeddedImageWriter`), so a racing removal leaves the load's link,
  which its commit puts back;
- it is older than `min_age_s` (at least `MIN_AGE_S`): a commit gives every image the
  load references a fresh mtime, covering the moments until the load's table is written;
- the tables could be read and name at least one image (an empty or unreadable catalog
  looks the same as "nothing referenced").
Removals and commits exclude each other (`store_lock`), so the check and the removal
see the same staging directories.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from mm_assets.common.files import make_dirs, temporary_name
from mm_assets.domain.ingest.embedded_images import embedded_image_path
from mm_assets.storage import TableStore

MIN_AGE_S = 3600.0
BATCH = 256  # removals per fresh read of the references
_STAGING = "staging"
_HEX = re.compile(r"^[0-9a-f]{64}$")
# Every table column that can name an embedded image: `sha256:<hex>` in rows and probes,
# the file's path (`.../sha256/<hex[:2]>/<hex>`) in conversations, its URL in messages.
IMAGE_COLUMNS = {
    "raw_dataset": "record",
    "coco_image_availability": "reference",
    "normalized_conversations": "turns",
    "target_responses": "turns",
    "tokenized_samples": "messages",
}
_DIGEST = r"sha256[:/](?:[0-9a-f]{2}/)?([0-9a-f]{64})"


@dataclass
class PruneReport:
    removed: list[Path] = field(default_factory=list)  # or would be, in a dry run
    removed_bytes: int = 0
    kept_young: int = 0  # unreferenced, but too fresh to be sure
    kept_referenced_again: int = 0  # unreferenced at the scan, referenced at the removal
    referenced: int = 0
    refused: str | None = None  # why nothing (more) was removed


def new_staging_dir(embedded_dir: Path) -> Path:
    """A load's own staging directory beside the store (swept once its writer is gone)."""
    return Path(embedded_dir).parent / temporary_name(_STAGING, "tmp")


def staged_digests(embedded_dir: Path) -> set[str]:
    """The images every load in flight (or killed, until swept) has staged or linked."""
    found: set[str] = set()
    for staging in Path(embedded_dir).parent.glob(f".{_STAGING}.*"):
        try:
            found.update(name for name in os.listdir(staging) if _HEX.match(name))
        except OSError:  # finished meanwhile (or not a directory)
            continue
    return found


@contextmanager
def store_lock(embedded_dir: Path, exclusive: bool) -> Iterator[None]:
    """Commits share it, a batch of removals holds it alone."""
    path = Path(embedded_dir).parent / ".store.lock"
    make_dirs(path.parent)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def table_digests(tables: TableStore) -> set[str] | None:
    """The digests the tables name (`IMAGE_COLUMNS`); None when none of them exists.
    Raises what DuckDB or the filesystem raise when one cannot be read."""
    present = [t for t in IMAGE_COLUMNS if t in tables.table_names()]
    if not present:
        return None
    sql = " UNION ".join(
        f"SELECT unnest(regexp_extract_all(CAST({IMAGE_COLUMNS[t]} AS VARCHAR), '{_DIGEST}', 1)) "
        f'FROM "{t}"'
        for t in present
    )
    with tables.connect() as con:
        return {digest for (digest,) in con.execute(sql).fetchall()}


def referenced_digests(tables: TableStore, embedded_dir: Path, report: PruneReport) -> set[str]:
    """What the tables and the loads in flight reference now. Empty (and `report.refused`
    set) when the tables cannot be read or name no image: then nothing may be removed."""
    try:
        named = table_digests(tables)
    except (duckdb.Error, OSError) as exc:
        report.refused = (
            f"the tables under {tables.location} could not be read ({exc}), so what they "
            "reference is unknown: nothing removed. Fix or rematerialize that table, then "
            "run the job again"
        )
        return set()
    if not named:
        report.refused = (
            f"no table under {tables.location} names an embedded image (an empty catalog, "
            "or a storage root other than the loads'): nothing removed. If no dataset "
            f"needs the images, delete {embedded_dir} by hand"
        )
        return set()
    return named | staged_digests(embedded_dir)


def _stored(embedded_dir: Path) -> Iterator[Path]:
    for path in sorted(Path(embedded_dir).glob("??/*")):
        if path == embedded_image_path(embedded_dir, path.name) and _HEX.match(path.name):
            yield path


def _age_s(path: Path) -> tuple[float, int] | None:
    try:
        stat = path.lstat()
    except FileNotFoundError:
        return None
    return time.time() - stat.st_mtime, stat.st_size


def prune_embedded_images(
    tables: TableStore,
    embedded_dir: Path,
    min_age_s: float = MIN_AGE_S,
    apply: bool = False,
    batch: int = BATCH,
) -> PruneReport:
    """The stored images nothing references, older than `min_age_s`: removed with
    `apply`, only listed without it. Each batch of removals reads the references again
    under the store's lock, and checks each image's age again, right before unlinking."""
    if not min_age_s >= MIN_AGE_S:
        raise ValueError(
            f"min_age_s={min_age_s}: an image younger than {MIN_AGE_S:.0f} s may belong to "
            "a load writing its table now; use at least that"
        )
    report = PruneReport()
    referenced = referenced_digests(tables, embedded_dir, report)
    if report.refused:
        return report
    report.referenced = len(referenced)
    candidates: list[tuple[Path, int]] = []  # with their sizes
    for path in _stored(embedded_dir):
        age = _age_s(path)
        if path.name in referenced or age is None:
            continue
        if age[0] < min_age_s:
            report.kept_young += 1
        else:
            candidates.append((path, age[1]))
    if not apply:
        report.removed = [path for path, _ in candidates]
        report.removed_bytes = sum(size for _, size in candidates)
        return report
    for start in range(0, len(candidates), batch):
        with store_lock(embedded_dir, exclusive=True):
            referenced = referenced_digests(tables, embedded_dir, report)
            if report.refused:
                return report
            for path, _ in candidates[start : start + batch]:
                age = _age_s(path)
                if path.name in referenced:
                    report.kept_referenced_again += 1
                elif age is not None and age[0] < min_age_s:
                    report.kept_young += 1
                elif age is not None:
                    path.unlink(missing_ok=True)
                    report.removed.append(path)
                    report.removed_bytes += age[1]
    return report
