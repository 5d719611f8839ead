"""What a draft reads of its sources' tables: the layer ids their states were stored
with, the rows that have states, and each row's conversation (to tell a conversation
two sources hold). Shared by training (`services.training`) and its reuse key."""

from __future__ import annotations

import json

from mm_assets.domain.model.draft_set import prompt_key
from mm_assets.domain.model.training_data import SAMPLE_COLUMNS, SampleRef, check_layer_ids
from mm_assets.registry import DraftSpec
from mm_assets.storage import TableStore

# each source's rows and their stored states (online, the rows alone), and with several
# sources the conversations that tell their duplicates
TRAINING_TABLES = ("tokenized_samples", "hidden_states_manifest")
ONLINE_TABLES = ("tokenized_samples",)
DUPLICATE_TABLES = ("normalized_conversations",)


def stored_layer_ids(tables: TableStore, partition: str) -> list[int]:
    """The layer ids of the partition's stored hidden states (one set for every row)."""
    found = {
        tuple(row["layer_ids"])
        for row in tables.iter_rows("hidden_states_manifest", partition, ["layer_ids"])
    }
    if len(found) != 1:
        state = "no stored row" if not found else f"rows of several layer ids {sorted(found)}"
        raise ValueError(
            f"hidden_states of {partition!r} has {state}: materialize hidden_states for "
            "this partition (with one `layer_ids`) before training"
        )
    return list(found.pop())


def sample_refs(tables: TableStore, partition: str, layer_ids: list[int]) -> list[SampleRef]:
    """Rows with stored hidden states, refusing states of other layer ids."""
    manifest = list(tables.iter_rows("hidden_states_manifest", partition))
    check_layer_ids(manifest, layer_ids)
    rows_of = tables.iter_rows("tokenized_samples", partition, SAMPLE_COLUMNS)
    tokens = {r["row_id"]: r for r in rows_of}
    rows = ((m, tokens.get(m["row_id"])) for m in manifest)
    return [
        SampleRef.of(t, str(tables.resolve(m["path"])))
        for m, t in rows
        if t is not None and len(t["input_ids"]) > 1
    ]


def draft_layer_ids(tables: TableStore, draft: DraftSpec) -> list[int]:
    """The layer ids every source's states were stored with (one set, or refused)."""
    found = {name: stored_layer_ids(tables, name) for name in draft.sources}
    if len({tuple(ids) for ids in found.values()}) != 1:
        raise ValueError(
            f"draft {draft.name!r}: its sources' hidden states have other layer ids "
            f"({found}); rematerialize hidden_states of each with the same layer_ids"
        )
    return next(iter(found.values()))


def row_keys(tables: TableStore, partition: str) -> dict[str, str]:
    """Each tokenized row's conversation prompt key, plus its place in the conversation
    (a row per reply has `/turnN` after the sample id)."""
    columns = ["sample_id", "turns", "image_hashes"]
    prompts = {
        row["sample_id"]: prompt_key(json.loads(row["turns"]), row["image_hashes"] or [])
        for row in tables.iter_rows("normalized_conversations", partition, columns)
    }
    return {
        row["row_id"]: prompts.get(row["sample_id"], row["sample_id"])
        + row["row_id"][len(row["sample_id"]) :]
        for row in tables.iter_rows("tokenized_samples", partition, ["row_id", "sample_id"])
    }
