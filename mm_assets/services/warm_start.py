"""Training from a published EAGLE-3 draft instead of random weights (`init_from`).

Adapting a published draft for the same target to a domain costs a fraction of training
one from scratch. The draft keeps its own vocabulary (`draft_vocab_size` does not apply)
and its weights; the frozen parts are the target's, and the optimizer starts fresh.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from mm_assets.common.hashing import file_sha256
from mm_assets.domain.model.draft_parts import DraftModel
from mm_assets.domain.model.draft_vocab import DraftVocab, draft_vocab_from_mapping
from mm_assets.domain.model.families import DraftConfig, DraftFamily, draft_from, fit_problems
from mm_assets.storage.checkpoints import read_checkpoint_config, read_weights
from mm_assets.storage.layout import WEIGHTS, StorageLayout, has_weights, weights

logger = logging.getLogger(__name__)
# what a draft is read from (not the rest of its repository: optimizer states, other formats)
HUB_FILES = ["config.json", WEIGHTS]


@dataclass(frozen=True)
class InitSource:
    """The draft a training starts from: the setting, its directory, its weights' hash
    (part of the reuse key) and, from the hub, the commit it was downloaded at."""

    given: str
    path: Path
    sha256: str
    revision: str | None = None

    def provenance(self) -> dict[str, str]:
        hub = {"init_revision": self.revision} if self.revision else {}
        given = {"init_from": self.given, "init_path": str(self.path)}
        return given | hub | {"init_sha256": self.sha256}


def locate(init_from: str, layout: StorageLayout, revision: str = "") -> InitSource:
    """`init_from` as a local directory, else the name of a draft trained under this
    storage root, else a hub repository at `revision` (downloaded: its config and
    weights only)."""
    local = Path(init_from).expanduser()
    commit = None
    if local.is_dir() or ("/" not in init_from and has_weights(layout.draft(init_from))):
        if revision:
            raise ValueError(
                f"init_revision {revision!r} pins a hub id, and init_from {init_from!r} is a "
                "local draft: leave init_revision empty"
            )
        path = local.resolve() if local.is_dir() else layout.draft(init_from)
    else:
        path, commit = _download(init_from, revision)
    if not has_weights(path):
        raise FileNotFoundError(
            f"init_from {init_from!r}: {path} holds no {WEIGHTS}; give a speculators-format "
            "EAGLE-3 draft (config.json and model.safetensors)"
        )
    return InitSource(init_from, path, file_sha256(weights(path)), commit)


def _download(repo_id: str, revision: str) -> tuple[Path, str]:
    """The draft's snapshot directory and its commit (the hub cache names each snapshot
    directory after its commit)."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=HUB_FILES))
    except Exception as error:  # the hub's errors vary by cause; the message says it
        raise FileNotFoundError(
            f"init_from {repo_id!r} is not a local directory, not a draft trained under the "
            f"storage root, and could not be fetched from the hub: {error}"
        ) from error
    if not revision:
        logger.warning(
            "init_from %r is unpinned: took the hub's newest commit, %s (recorded in the "
            "checkpoint); set init_revision to it to train from the same draft again",
            repo_id,
            path.name,
        )
    return path, path.name


def warm_draft(
    source: InitSource,
    family: DraftFamily,
    target: DraftConfig,
    layer_ids: list[int],
    embed: torch.Tensor,
) -> tuple[DraftModel, DraftVocab]:
    """The draft as `source` left it, refused when it is of another family or was made
    for another target or other states (its config is checked before its weights are
    opened); its vocabulary. `embed` (the target's) fills in checkpoints that leave the
    frozen embeddings out."""
    config = read_checkpoint_config(source.path)
    problems = fit_problems(config, family, target, layer_ids)
    if problems:
        raise ValueError(
            f"init_from {source.given!r} ({source.path}) does not fit this target: "
            f"{'; '.join(problems)}. Start from a draft trained for this target and these "
            "layer ids, or leave init_from empty"
        )
    state = read_weights(source.path)
    state.setdefault("embed_tokens.weight", embed)
    model = draft_from(config, state, str(source.path))
    if (d2t := state.get("d2t")) is None:
        return model, DraftVocab(torch.arange(target.vocab_size), target.vocab_size)
    return model, draft_vocab_from_mapping(d2t, target.vocab_size)
