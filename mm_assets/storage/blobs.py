"""Content-addressed blobs (hidden-state files) under `<root>/blobs/<kind>/`.

A blob is named by its content key, so a rerun, a reordered dataset or an edit of other
rows finds every unchanged sample already stored. Files arrive by rename from a directory
on the same filesystem (`incoming_dir`), so a blob is either complete or absent.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mm_assets.common.files import (
    atomic_path,
    atomic_write_text,
    move_into_place,
    remove_stale_temporaries,
    temporary_name,
)

if TYPE_CHECKING:
    import torch


class BlobStore:
    """Blobs of one kind: hidden states (safetensors), target responses (JSON)."""

    def __init__(
        self, root: Path | str, kind: str = "hidden_states", suffix: str = ".safetensors"
    ) -> None:
        self.root = Path(root)
        self.dir = self.root / "blobs" / kind
        self.dir.mkdir(parents=True, exist_ok=True)
        self.suffix = suffix

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}{self.suffix}"

    def stored_path(self, key: str) -> str:
        """The blob's path relative to the storage root, as tables record it, so a root
        mounted elsewhere or moved still resolves it (`TableStore.resolve`)."""
        return self.path(key).relative_to(self.root).as_posix()

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def _fresh(self, under: str, name: str) -> Path:
        """A new name in `<blobs>/<under>/`, this process's: the next run sweeps it if dead."""
        parent = self.dir.parent / under
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(parent)
        return parent / temporary_name(name)

    def incoming_dir(self) -> Path:
        """A fresh directory on the blobs' filesystem for a server to write into."""
        path = self._fresh("incoming", "run")
        path.mkdir()
        return path

    def scratch(self) -> BlobStore:
        """A fresh store beside this one for blobs kept briefly (online training's `discard`)."""
        kind = self._fresh("scratch", self.dir.name).relative_to(self.dir.parent)
        return BlobStore(self.root, kind.as_posix(), self.suffix)

    def put_file(
        self,
        src: Path,
        key: str,
        verify: Callable[[Path], None] | None = None,
        copy_from: str | None = None,
    ) -> Path:
        """Move a finished file in, checked by `verify` first (`move_into_place`)."""
        dest = self.path(key)
        move_into_place(src, dest, verify, copy_from)
        return dest

    def put_tensors(
        self, tensors: dict[str, torch.Tensor], key: str, metadata: dict[str, str] | None = None
    ) -> Path:
        from safetensors.torch import save_file

        dest = self.path(key)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        with atomic_path(dest, expected_bytes=size) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata)
        return dest

    def put_json(self, value: Any, key: str) -> Path:
        dest = self.path(key)
        atomic_write_text(dest, json.dumps(value, ensure_ascii=False))
        return dest

    def get_json(self, key: str) -> Any:
        """The JSON blob under `key`, or None when there is none (or it is unreadable)."""
        try:
            return json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.dir).free
