"""Drafts trained on several datasets: registry validation and the training set (caps,
cross-source dedup, per-source held-out rows, the union's vocabulary) on planted data."""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_assets.domain.model.draft_set import SourceRows, draft_set, prompt_key, source_of
from mm_assets.domain.model.settings import SpeculatorSettings
from mm_assets.domain.model.training_data import SampleRef
from mm_assets.registry import DatasetSpec, load_drafts, load_registry
from mm_assets.registry.drafts import parse_drafts
from mm_assets.services.settings import STAGE_SETTINGS

DATASETS = {
    name: DatasetSpec(name=name, path="x", format="sharegpt", settings=settings)
    for name, settings in (
        ("chat", {}),
        ("vision", {}),
        ("deep", {"hidden_states": {"layer_ids": [1, 2, 3, 4]}}),
        ("live", {"trained_speculator": {"hidden_states": "online"}}),
    )
}


def test_a_draft_names_its_sources_caps_and_settings() -> None:
    entry = {"sources": {"chat": {"max_rows": 300}, "vision": {"fraction": 0.5}, "live": None},
             "epochs": 4}  # fmt: skip
    entry["sources"].pop("live")
    (draft,) = parse_drafts({"mix": entry}, "f.yaml", DATASETS, STAGE_SETTINGS).values()
    assert draft.sources["chat"].max_rows == 300 and draft.sources["vision"].fraction == 0.5
    assert draft.settings == {"trained_speculator": {"epochs": 4}} and not draft.is_dataset
    # a source fetched online: the draft fetches online too
    live = {"sources": {"chat": {}, "live": {}}, "hidden_states": "online"}
    (draft,) = parse_drafts({"live_mix": live}, "f.yaml", DATASETS, STAGE_SETTINGS).values()
    assert draft.settings == {"trained_speculator": {"hidden_states": "online"}}
    # a block draft of the same rows: the family is a setting like any other
    block = {"sources": {"vision": {}}, "draft": "dflash", "dflash_layers": 3}
    (draft,) = parse_drafts({"block": block}, "f.yaml", DATASETS, STAGE_SETTINGS).values()
    assert draft.settings == {"trained_speculator": {"draft": "dflash", "dflash_layers": 3}}


def test_bad_drafts_are_refused_naming_file_draft_and_field() -> None:
    bad = {
        "chat": {"sources": {"vision": {}}},
        "typo": {"sources": {"vison": {}, "chat": {"max_row": 3}}, "epoch": 2},
        "caps": {"sources": {"chat": {"max_rows": 0}, "vision": {"max_rows": 3, "fraction": 0.1}}},
        "layers": {"sources": {"chat": {}, "deep": {}}},
        "online": {"sources": {"chat": {}, "live": {}}},
        "shape": {"sources": ["chat"]},
        "family": {"sources": {"chat": {}}, "draft": "medusa"},
    }
    with pytest.raises(ValueError) as info:
        parse_drafts(bad, "f.yaml", DATASETS, STAGE_SETTINGS)
    text = str(info.value)
    lines = text.splitlines()
    assert all(line.startswith("f.yaml: draft '") for line in lines)
    assert "draft 'chat': a dataset has this name" in text
    assert "draft 'typo': unknown setting 'epoch' (did you mean 'epochs'?" in text
    assert "'sources.vison': unknown dataset (did you mean 'vision'?" in text
    assert "sources.chat.max_row: unknown key 'max_row' (did you mean 'max_rows'?" in text
    assert "'sources.chat.max_rows': input should be greater than 0" in text
    assert "give max_rows or fraction, not both" in text
    assert "draft 'layers': 'sources': their hidden_states layer_ids differ" in text
    assert "draft 'online': 'sources': live fetch hidden states online" in text
    assert "draft 'shape': expected a mapping with 'sources'" in text
    assert "draft 'family'" in text and "'eagle3', 'dflash' or 'peagle', got 'medusa'" in text


def test_a_draft_name_that_is_not_one_plain_directory_name_is_refused_naming_it() -> None:
    """`../../x` would put the draft's directory outside `speculators/` (and a retrain
    replaces that directory whole); every such name is refused as the registry loads."""
    names = ["../../x", "a/b", "..", ".hidden", "a..b"]
    with pytest.raises(ValueError) as info:
        parse_drafts({n: {"sources": {"chat": {}}} for n in names}, "f.yaml", DATASETS, {})
    lines = str(info.value).splitlines()
    assert [line.split(": a draft name may hold ")[0] for line in lines] == [
        f"f.yaml: draft {n!r}" for n in names
    ]
    assert all("without '..'" in line for line in lines)


def test_every_training_dataset_is_its_own_draft_and_the_demo_mix_is_built_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MM_ASSETS_DATASETS", str(tmp_path / "absent.yaml"))
    datasets = load_registry(STAGE_SETTINGS)
    drafts = load_drafts(datasets, STAGE_SETTINGS)
    trained = [name for name, spec in datasets.items() if not spec.is_benchmark]
    assert all(drafts[name].is_dataset for name in trained) and "demo_benchmark" in datasets
    assert "demo_benchmark" not in drafts  # a benchmark is never trained on
    mix = drafts["demo_mix"]
    assert list(mix.sources) == ["demo_sharegpt4v_coco", "demo_sharegpt"] and not mix.is_dataset
    assert mix.benchmarks == ("demo_benchmark",)  # its sources' benchmarks
    assert mix.settings["speculator_benchmark"] == {"max_tokens": 64, "max_prompts_per_category": 3}
    assert "drafts" not in datasets


def _source(name: str, rows: dict[str, str], **cap: int | float) -> SourceRows:
    """Rows named `row_id` -> prompt key; each row 8 tokens, the last 4 supervised."""
    refs = [SampleRef(row, f"{name}/{row}", list(range(i, i + 8)), [0] * 4 + [1] * 4)
            for i, row in enumerate(rows)]  # fmt: skip
    return SourceRows(name, refs, rows, **cap)


def test_a_conversation_in_two_sources_trains_once_and_is_counted_per_pair() -> None:
    chat = _source("chat", {f"c{i}": f"k{i}" for i in range(60)})
    vision = _source("vision", {f"v{i}": f"k{i}" if i < 7 else f"v{i}" for i in range(50)})
    third = _source("third", {"t0": "k3", "t1": "v8", "t2": "t2"})
    built = draft_set([chat, vision, third], held_out_fraction=0.1, seed=0)
    rows = built.train + built.held_out
    assert len(rows) == len({r.row_id for r in rows}) == 60 + 43 + 1
    assert built.duplicates == {"chat/vision": 7, "chat/third": 1, "vision/third": 1}
    assert built.figures["vision"].duplicates == 7 and built.figures["third"].duplicates == 2
    assert {source_of(r.row_id)[0] for r in rows} == {"chat", "vision", "third"}
    assert source_of("vision:v9/turn3") == ("vision", "v9/turn3")


def test_caps_are_exact_seeded_and_stable_when_rows_are_added() -> None:
    rows = {f"r{i}": f"r{i}" for i in range(200)}
    built = draft_set([_source("big", rows, max_rows=50)], 0.1, seed=0)
    kept = {r.row_id for r in built.train + built.held_out}
    assert len(kept) == 50 and built.figures["big"].capped == 150
    again = draft_set([_source("big", rows, max_rows=50)], 0.1, seed=0)
    assert kept == {r.row_id for r in again.train + again.held_out}
    reseeded = draft_set([_source("big", rows, max_rows=50)], 0.1, seed=1)
    assert kept != {r.row_id for r in reseeded.train + reseeded.held_out}
    grown = draft_set([_source("big", {**rows, "new": "new"}, max_rows=50)], 0.1, seed=0)
    assert len(kept - {r.row_id for r in grown.train + grown.held_out}) <= 1
    half = draft_set([_source("big", rows, fraction=0.5)], 0.1, seed=0)
    assert 70 <= half.figures["big"].rows <= 130


def test_a_split_seed_keeps_the_held_out_rows_while_the_seed_changes() -> None:
    """Drafts trained under several seeds are compared on the same held-out prompts."""
    rows = {f"r{i}": f"r{i}" for i in range(200)}

    def held_out(settings: SpeculatorSettings) -> set[str]:
        built = draft_set([_source("s", rows)], 0.1, seed=settings.held_out_seed)
        return {r.row_id for r in built.held_out}

    today = held_out(SpeculatorSettings())
    assert held_out(SpeculatorSettings(seed=1, split_seed=0)) == today
    assert held_out(SpeculatorSettings(seed=1)) != today
    assert held_out(SpeculatorSettings(split_seed=1)) == held_out(SpeculatorSettings(seed=1))


def test_every_source_holds_out_at_least_the_minimum_by_the_specialists_rule() -> None:
    """A source's held-out rows are those its own draft holds out (same rule, same ids),
    topped up to the minimum: the mix is measured on the specialist's prompts."""
    big = _source("big", {f"b{i}": f"b{i}" for i in range(400)})
    small = _source("small", {f"s{i}": f"s{i}" for i in range(40)})
    built = draft_set([big, small], held_out_fraction=0.1, seed=0, min_held_out=16)
    held = {source_of(r.row_id) for r in built.held_out}
    from mm_assets.domain.model.training_data import is_held_out

    alone = {("big", r.row_id) for r in big.refs if is_held_out(r.row_id, 0.1, 0)}
    assert alone <= held and len(alone) >= 16
    assert sum(1 for s, _ in held if s == "small") == 16 == built.figures["small"].held_out
    assert built.figures["small"].rows == 40 and built.figures["small"].supervised == 160


def test_the_vocabulary_counts_the_union_once() -> None:
    a = _source("a", {"x": "same", "y": "y"})
    b = _source("b", {"z": "same"})
    built = draft_set([a, b], 0.0, seed=0)
    # rows x (ids 0..7) and y (ids 1..8), supervised the last four of each
    assert built.frequencies == {4: 1, 5: 2, 6: 2, 7: 2, 8: 1}


def test_the_prompt_key_ignores_the_replies_not_the_prompt_or_images() -> None:
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
             {"role": "assistant", "content": "a cat"}]  # fmt: skip
    other_reply = [turns[0], {"role": "assistant", "content": "a dog"}]
    assert prompt_key(turns, ["h1"]) == prompt_key(other_reply, ["h1"])
    assert prompt_key(turns, ["h1"]) != prompt_key(turns, ["h2"])
    asked_otherwise = [{"role": "user", "content": "who?"}, turns[1]]
    assert prompt_key(asked_otherwise, []) != prompt_key(turns, ["h1"])


def test_a_draft_reads_exactly_its_sources() -> None:
    from mm_assets.assets.partitions import (
        DRAFTS,
        dataset_partitions,
        draft_partitions,
        sources_of_drafts,
    )

    mapping = sources_of_drafts()
    for name, draft in DRAFTS.items():
        upstream = mapping.get_upstream_mapped_partitions_result_for_partitions(
            draft_partitions.subset_with_partition_keys([name]), draft_partitions,
            dataset_partitions,
        ).partitions_subset.get_partition_keys()  # fmt: skip
        assert set(upstream) == set(draft.sources)


def test_automation_runs_a_draft_once_all_its_sources_are_stored_and_once_per_change() -> None:
    """With the real `trained_draft` (its automation condition and partition mapping):
    one source stored -> nothing; both -> one run; both changed in one refresh -> one
    run, not one per source."""
    import dagster as dg

    from mm_assets.assets.drafts import trained_draft
    from mm_assets.assets.partitions import dataset_partitions
    from mm_assets.definitions import defs as product

    @dg.asset(name="hidden_states", partitions_def=dataset_partitions)
    def states() -> None: ...

    defs = dg.Definitions(assets=[states, trained_draft], resources=product.resources)
    instance = dg.DagsterInstance.ephemeral()
    mix, key = "demo_mix", dg.AssetKey("trained_draft")

    def stored(asset: str, partition: str, version: str) -> None:
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                asset, partition=partition, tags={"dagster/data_version": version}
            )
        )

    def requested(cursor=None) -> tuple[list[str], object]:
        result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
        return sorted(result.get_requested_partitions(key)), result.cursor

    assert requested()[0] == []
    stored("hidden_states", "demo_sharegpt4v_coco", "a1")
    runs, cursor = requested()
    assert runs == []
    stored("hidden_states", "demo_sharegpt", "b1")
    runs, cursor = requested(cursor)
    assert runs == [mix]
    stored("trained_draft", mix, "d1")
    runs, cursor = requested(cursor)
    assert runs == []
    stored("hidden_states", "demo_sharegpt4v_coco", "a2")
    stored("hidden_states", "demo_sharegpt", "b2")
    runs, cursor = requested(cursor)
    assert runs == [mix]


@pytest.mark.slow
def test_a_draft_of_both_demo_datasets_through_the_cli_serves_in_vllm_losslessly(
    demo_hidden_states, plain_vllm_server
) -> None:
    """`dagster asset materialize --select trained_draft --partition demo_mix` after both
    sources' hidden states: trained from their stored states (no extraction), held out
    and measured per source, and vLLM serves the checkpoint with speculative decoding,
    greedy outputs equal to the target's own without a draft."""
    import json
    import os
    import subprocess
    import sys

    from mm_assets.clients.vllm_generation import generate_greedy
    from tests.conftest import SESSION_HOME
    from tests.test_cli import REPO, _latest_metadata

    config = {"epochs": 2, "vllm_prompts": 6, "compare_with_sources": False}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "asset", "materialize", "-m",
         "mm_assets.definitions", "--select", "trained_draft", "--partition", "demo_mix",
         "--config-json", json.dumps({"ops": {"trained_draft": {"config": config}}})],
        env=dict(os.environ), cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = _latest_metadata(dict(os.environ), "trained_draft")
    sources = ("demo_sharegpt4v_coco", "demo_sharegpt")
    assert all(meta[f"rows_{s}"] > 0 and meta[f"vllm_prompts_{s}"] == 6 for s in sources)
    assert all(meta[f"vllm_acceptance_length_{s}"] >= 1.0 for s in sources)
    assert "| **demo_mix** |" in meta["vllm_acceptance_by_source"]
    from mm_assets.assets.resources import StorageResource

    with StorageResource().tables().connect() as con:
        found = con.execute(
            "SELECT served, source, acceptance_length, prompts, drafts FROM draft_measurements "
            "WHERE draft = 'demo_mix'"
        ).fetchall()
    table = {(served, source): rest for served, source, *rest in found}
    assert set(table) == {("trained", s) for s in (*sources, "overall")}
    for s in sources:
        accepted, prompts, _ = table[("trained", s)]
        assert accepted == pytest.approx(meta[f"vllm_acceptance_length_{s}"], rel=1e-3)
        assert prompts == 6
    assert table[("trained", "overall")][2] == sum(table[("trained", s)][2] for s in sources)
    from mm_assets.services.measurement import measurement_record

    record = json.loads(measurement_record(SESSION_HOME, "demo_mix", "demo_mix").read_text())[
        "payload"
    ]
    for source in sources:
        prompts, generations = record[source]["prompts"], record[source]["generations"]
        plain = generate_greedy(
            plain_vllm_server.base_url, plain_vllm_server.access, prompts, max_tokens=64
        )
        assert generations == plain, source


def test_the_reuse_key_follows_every_source_table_and_cap(tmp_path: Path) -> None:
    """A draft retrains when any source's table changes (by content) or a cap changes,
    and not when a table is rewritten with the same rows or another dataset changes."""
    from mm_assets.registry import DraftSpec, SourceCap
    from mm_assets.services.draft_sources import DUPLICATE_TABLES, TRAINING_TABLES
    from mm_assets.services.training import SpeculatorJob, training_key
    from mm_assets.storage import open_tables, schemas

    tables = open_tables(tmp_path)
    shapes = {
        "tokenized_samples": schemas.TOKENIZED, "hidden_states_manifest": schemas.MANIFEST,
        "normalized_conversations": schemas.NORMALIZED,
    }  # fmt: skip
    assert set(shapes) == {*TRAINING_TABLES, *DUPLICATE_TABLES}

    def write(partition: str, table: str, value: int) -> None:
        row = {"row_id": f"r{value}", "sample_id": f"r{value}"}
        tables.write(table, partition, [row], shapes[table])

    for partition in ("a", "b", "other"):
        for table in shapes:
            write(partition, table, 1)
    draft = DraftSpec(name="mix", sources={"a": SourceCap(), "b": SourceCap(max_rows=5)})
    job = SpeculatorJob("mix", tmp_path, tmp_path, {}, "fp", [1, 2, 3, 4], SpeculatorSettings())
    key = training_key(job, draft, tables)
    write("b", "tokenized_samples", 1)
    write("other", "tokenized_samples", 2)
    assert training_key(job, draft, tables) == key
    write("b", "normalized_conversations", 2)
    assert training_key(job, draft, tables) != key
    write("b", "normalized_conversations", 1)
    assert training_key(job, draft, tables) == key
    capped = DraftSpec(name="mix", sources={"a": SourceCap(), "b": SourceCap(max_rows=6)})
    assert training_key(job, capped, tables) != key
