"""Images kept inside dataset rows: taken out, written once by content hash, probed as files."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from PIL import Image

from mm_assets.domain.ingest.embedded_images import (
    EMBEDDED_PREFIX,
    INVALID_PREFIX,
    embedded_image_path,
    embedded_references,
    extract_embedded_images,
)
from mm_assets.domain.ingest.images import ImageStatus, probe_reference
from tests.bad_inputs import png_declaring


def _png(size: tuple[int, int] = (20, 10), color: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def _jpeg(size: tuple[int, int] = (64, 48)) -> bytes:
    out = io.BytesIO()
    Image.effect_noise(size, 60).convert("RGB").save(out, format="JPEG", quality=95)
    return out.getvalue()


def _ref(data: bytes) -> str:
    return EMBEDDED_PREFIX + hashlib.sha256(data).hexdigest()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


PNG = _png()


# -- the walk ------------------------------------------------------------------------


def test_an_image_struct_becomes_its_content_reference() -> None:
    found = extract_embedded_images({"question": "Which?", "image": {"bytes": PNG, "path": None}})
    assert found.record == {"question": "Which?", "image": _ref(PNG)}
    assert found.images == {hashlib.sha256(PNG).hexdigest(): PNG}
    json.dumps(found.record)  # no bytes left


def test_a_plain_bytes_dict_and_raw_bytes_are_images() -> None:
    other = _png(color="blue")
    found = extract_embedded_images({"a": {"bytes": PNG}, "b": bytearray(other)})
    assert found.record == {"a": _ref(PNG), "b": _ref(other)}
    assert len(found.images) == 2


def test_a_struct_without_bytes_names_its_file_and_an_empty_struct_no_image() -> None:
    found = extract_embedded_images(
        {
            "image": {"bytes": None, "path": "train2017/a.jpg"},
            "other": {"bytes": None, "path": None},
        }
    )
    assert found.record == {"image": "train2017/a.jpg", "other": None}
    assert found.images == {} and found.found == 0


def test_data_urls_alone_and_in_image_url_parts_are_images() -> None:
    record = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(PNG)}},
                    {"type": "text", "text": "data:image/png;base64, is how it starts"},
                ],
            }
        ],
        "image": "data:image/PNG;Base64," + base64.b64encode(PNG).decode(),
    }
    found = extract_embedded_images(record)
    part = found.record["messages"][0]["content"]
    assert part[0] == {"type": "image_url", "image_url": {"url": _ref(PNG)}}
    assert part[1]["text"].startswith("data:image/png;base64, is")  # a text part's text stays text
    assert found.record["image"] == _ref(PNG)
    assert found.found == 2 and len(found.images) == 1  # the same bytes twice: one image


def test_text_that_reads_like_a_data_url_is_never_rewritten() -> None:
    """Only the keys images are read from hold images: a user's question or an
    assistant's reply that starts with `data:image/` stays as written (the row used to
    be kept for training with its text replaced by a hash)."""
    url = _data_url(PNG)
    record = {
        "conversations": [
            {"from": "human", "value": url},
            {"from": "gpt", "value": "data:image/png;base64,@@ is how a data URL starts"},
        ],
        "messages": [{"role": "user", "content": url}],
        "question": url,
        "photo": url,
    }
    found = extract_embedded_images(record)
    assert found.record == record and found.found == 0
    configured = extract_embedded_images(record, frozenset({"photo"}))
    assert configured.record["photo"] == _ref(PNG) and configured.record["question"] == url


def test_a_data_url_whose_base64_does_not_decode_becomes_an_invalid_reference() -> None:
    found = extract_embedded_images({"image": "data:image/png;base64,@@not base64@@"})
    assert found.record["image"].startswith(INVALID_PREFIX + "the data URL's base64")
    assert found.images == {}
    plain = extract_embedded_images({"image": "data:image/svg+xml,<svg/>"}).record["image"]
    assert plain.startswith(INVALID_PREFIX) and "base64" in plain


def test_lists_and_nesting_keep_their_order() -> None:
    blue, green = _png(color="blue"), _png(color="green")
    record = {"images": [{"bytes": PNG, "path": "a.png"}, [blue, {"x": {"bytes": green}}]]}
    found = extract_embedded_images(record)
    assert found.record == {"images": [_ref(PNG), [_ref(blue), {"x": _ref(green)}]]}
    assert embedded_references(found.record) == [_ref(PNG), _ref(blue), _ref(green)]


def test_empty_bytes_and_non_images_are_still_taken_out_for_the_probe_to_judge() -> None:
    found = extract_embedded_images({"a": b"", "image": _data_url(b"not an image")})
    assert found.record == {"a": _ref(b""), "image": _ref(b"not an image")}


def test_a_decoded_pil_image_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"Image\(decode=False\)"):
        extract_embedded_images({"image": Image.new("RGB", (2, 2))})


# -- resolving and probing ---------------------------------------------------------


def test_a_sha256_reference_is_probed_in_the_embedded_directory(tmp_path: Path) -> None:
    embedded, root = tmp_path / "images", tmp_path / "coco"
    path = embedded_image_path(embedded, hashlib.sha256(PNG).hexdigest())
    path.parent.mkdir(parents=True)
    path.write_bytes(PNG)
    probe = probe_reference(root, _ref(PNG), embedded_dir=embedded)
    assert probe.status is ImageStatus.OK and (probe.width, probe.height) == (20, 10)
    assert probe.content_hash == hashlib.sha256(PNG).hexdigest() and probe.path == str(path)
    absent = probe_reference(root, _ref(b"never written"), embedded_dir=embedded)
    assert absent.status is ImageStatus.MISSING


@pytest.mark.parametrize(
    ("reference", "says"),
    [
        (INVALID_PREFIX + "the data URL's base64 does not decode", "does not decode"),
        ("sha256:1234", "64 lowercase hex"),
        ("data:text/plain;base64,aGk=", "not data:image"),
    ],
)
def test_references_that_name_no_embedded_image_are_invalid(
    tmp_path: Path, reference: str, says: str
) -> None:
    probe = probe_reference(tmp_path, reference, embedded_dir=tmp_path)
    assert probe.status is ImageStatus.INVALID_REFERENCE and says in probe.detail
    assert probe.path is None


def test_a_sha256_reference_without_an_embedded_directory_is_invalid(tmp_path: Path) -> None:
    probe = probe_reference(tmp_path, _ref(PNG))
    assert probe.status is ImageStatus.INVALID_REFERENCE


# -- reading sources ---------------------------------------------------------------


def _mmstar_parquet(path: Path, images: list[bytes | None]) -> None:
    """A Parquet file shaped like Lin-Chen/MMStar, written by `datasets` itself."""
    from datasets import Dataset, Features, Value
    from datasets import Image as ImageFeature

    features = Features(
        {
            "index": Value("int64"),
            "question": Value("string"),
            "image": ImageFeature(),
            "answer": Value("string"),
            "category": Value("string"),
            "l2_category": Value("string"),
            "meta_info": {"source": Value("string"), "split": Value("string")},
        }
    )
    n = len(images)
    Dataset.from_dict(
        {
            "index": list(range(n)),
            "question": [f"Question {i}? Options: A, B" for i in range(n)],
            "image": [None if b is None else {"bytes": b, "path": None} for b in images],
            "answer": ["A"] * n,
            "category": ["coarse perception", "math"] * (n // 2) + ["math"] * (n % 2),
            "l2_category": ["image scene"] * n,
            "meta_info": [{"source": "MMBench", "split": "val"}] * n,
        },
        features=features,
    ).to_parquet(str(path))


def test_the_hub_path_reads_image_columns_undecoded_and_names_each_file(tmp_path: Path) -> None:
    from datasets import Dataset, Features, List, Value
    from datasets import Image as ImageFeature

    from mm_assets.services.ingest import hub_source

    blue = _png(color="blue")
    features = Features({"q": Value("string"), "images": List(ImageFeature())})
    for name, images in (("b.parquet", [blue]), ("a.parquet", [PNG, blue])):
        Dataset.from_dict(
            {"q": [name], "images": [[{"bytes": b, "path": None} for b in images]]},
            features=features,
        ).to_parquet(str(tmp_path / name))
    rows = list(hub_source(str(tmp_path), None, "test", ["b.parquet", "a.parquet"])())
    assert [(r.source_index, r.source_file) for r in rows] == [(0, "b.parquet"), (1, "a.parquet")]
    assert [i["bytes"] for i in rows[1].record["images"]] == [PNG, blue]  # bytes, not pixels


def test_a_local_directory_reads_only_its_data_files_in_their_order(tmp_path: Path) -> None:
    from mm_assets.services.ingest import read_local

    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"q": name}) + "\n")
    rows = list(read_local(tmp_path, ["c.jsonl", "a.jsonl"]))
    assert [(r.source_index, r.record["q"], r.source_file) for r in rows] == [
        (0, "c", "c.jsonl"),
        (1, "a", "a.jsonl"),
    ]
    with pytest.raises(FileNotFoundError, match=r"data_files entry 'd\.jsonl'"):
        list(read_local(tmp_path, ["d.jsonl"]))


def test_data_files_and_links_stay_under_the_dataset_path(tmp_path: Path) -> None:
    """`../`, absolute entries and links out of the directory are never read: a linked
    credentials file's lines would otherwise land in raw_dataset."""
    from mm_assets.services.ingest import read_local

    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir(), outside.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"q": "a"}) + "\n")
    (outside / "secret.jsonl").write_text("aws_secret_access_key = abc\n")
    (data / "link.jsonl").symlink_to(outside / "secret.jsonl")
    assert [r.record for r in read_local(data)] == [{"q": "a"}]  # the link is skipped
    for entry, says in [("../outside/*.jsonl", "outside the entry's 'path'"),
                        ("link.jsonl", "outside the entry's 'path'"),
                        (str(outside / "secret.jsonl"), "is absolute")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            list(read_local(data, [entry]))


# -- through the assets ------------------------------------------------------------


def _statuses(tables, partition: str) -> dict[str, str]:
    return {
        r["reference"]: r["status"] for r in tables.iter_rows("coco_image_availability", partition)
    }


def _stored_images(home: Path) -> list[Path]:
    return sorted(p for p in (home / "images" / "sha256").rglob("*") if p.is_file())


def test_an_mmstar_shaped_parquet_loads_with_every_image_written_once() -> None:
    from mm_assets.assets.resources import StorageResource
    from tests.conftest import SESSION_HOME, materialize

    images = [_jpeg((64 + i, 48)) for i in range(5)]
    images.append(images[0])  # the same bytes in two rows: one file
    source = SESSION_HOME / "embedded" / "mmstar.parquet"
    source.parent.mkdir(parents=True, exist_ok=True)
    _mmstar_parquet(source, images)

    result = materialize("embedded_mmstar", ["raw_dataset", "coco_image_availability"])

    assert result.success
    tables = StorageResource().tables()
    rows = list(tables.iter_rows("raw_dataset", "embedded_mmstar"))
    records = [json.loads(r["record"]) for r in rows]
    assert [r["image"] for r in records] == [_ref(b) for b in images]
    assert {r["source_file"] for r in rows} == {"mmstar.parquet"}
    assert records[0]["meta_info"] == {"source": "MMBench", "split": "val"}
    stored = {p.name: p.read_bytes() for p in _stored_images(SESSION_HOME)}
    assert all(stored[_ref(b)[len(EMBEDDED_PREFIX) :]] == b for b in images)
    (raw,) = result.asset_materializations_for_node("raw_dataset")
    counts = raw.metadata["embedded_images"].value
    assert (counts["seen"], counts["distinct"]) == (6, 5)
    assert _statuses(tables, "embedded_mmstar") == {_ref(b): "ok" for b in images}
    sizes = {
        r["reference"]: (r["width"], r["height"], r["format"])
        for r in tables.iter_rows("coco_image_availability", "embedded_mmstar")
    }
    assert sizes[_ref(images[2])] == (66, 48, "JPEG")

    again = materialize("embedded_mmstar", ["raw_dataset"])
    (raw,) = again.asset_materializations_for_node("raw_dataset")
    assert raw.metadata["embedded_images"].value["written"] == 0  # all there already


def test_broken_embedded_images_get_a_status_each_and_good_ones_stay_ok(tmp_path: Path) -> None:
    from mm_assets.assets.resources import StorageResource
    from tests.conftest import SESSION_HOME, materialize

    good, other = _jpeg(), _png((30, 30), "green")
    png_declaring(tmp_path / "bomb.png", 20_000, 20_000)  # 400 Mpx declared, never decoded
    bomb = (tmp_path / "bomb.png").read_bytes()
    cut = good[: len(good) // 2]
    directory = SESSION_HOME / "embedded" / "adversarial"
    directory.mkdir(parents=True, exist_ok=True)
    _mmstar_parquet(directory / "images.parquet", [good, cut, bomb, b"", None])
    urls = [
        _data_url(other),
        _data_url(b"this is text, not a picture"),
        "data:image/jpeg;base64,%%%not-base64%%%",
        [_data_url(good), _data_url(other)],  # a list of images in one row
    ]
    (directory / "data_urls.jsonl").write_text(
        "".join(json.dumps({"question": f"q{i}", "image": u}) + "\n" for i, u in enumerate(urls))
    )
    (directory / "unlisted.jsonl").write_text(json.dumps({"question": "never read"}) + "\n")

    result = materialize("embedded_adversarial", ["raw_dataset", "coco_image_availability"])

    assert result.success
    tables = StorageResource().tables()
    rows = list(tables.iter_rows("raw_dataset", "embedded_adversarial"))
    assert [r["source_file"] for r in rows] == ["images.parquet"] * 5 + ["data_urls.jsonl"] * 4
    statuses = _statuses(tables, "embedded_adversarial")
    (invalid,) = [ref for ref in statuses if ref.startswith(INVALID_PREFIX)]
    assert statuses == {
        _ref(good): "ok",
        _ref(other): "ok",
        _ref(cut): "unreadable",
        _ref(bomb): "too_large",
        _ref(b""): "empty",
        _ref(b"this is text, not a picture"): "unreadable",
        invalid: "invalid_reference",
    }
    details = {
        r["reference"]: r["detail"]
        for r in tables.iter_rows("coco_image_availability", "embedded_adversarial")
    }
    assert "truncated JPEG" in details[_ref(cut)]
    assert "base64" in details[invalid]
    bomb_file = embedded_image_path(
        SESSION_HOME / "images" / "sha256", _ref(bomb)[len(EMBEDDED_PREFIX) :]
    )
    assert bomb_file.read_bytes() == bomb  # written as given; only its header was read


# -- what vLLM may read ------------------------------------------------------------


@pytest.mark.parametrize(
    ("probed", "expected"),
    [
        ([("coco/a.jpg", "ok")], "image_root"),
        ([(_ref(PNG), "ok")], "embedded"),
        ([("coco/a.jpg", "ok"), (_ref(PNG), "ok")], "image_root"),
        ([("coco/a.jpg", "missing"), (_ref(PNG), "ok")], "embedded"),
        ([(_ref(PNG), "unreadable")], None),
        ([], None),
    ],
)
def test_vllm_opens_one_narrow_directory_never_a_common_parent(
    tmp_path: Path, probed: list[tuple[str, str]], expected: str | None
) -> None:
    from mm_assets.registry import DatasetSpec
    from mm_assets.services.media import media_root
    from mm_assets.storage import TableStore, schemas

    storage_root, image_root = tmp_path / "store", tmp_path / "data" / "coco"
    spec = DatasetSpec(name="d", path="d.jsonl", format="prompts", image_root=str(image_root))
    tables = TableStore(storage_root)
    # nothing probed in this store yet: the entry's own image root
    assert media_root(spec, tables, storage_root) == spec.resolved_image_root()
    rows = [
        {"reference": ref, "status": status, "referenced_by": 1, "path": None}
        for ref, status in probed
    ]
    tables.write("coco_image_availability", "d", rows, schemas.IMAGE_AVAILABILITY)
    roots = {
        "image_root": image_root.resolve(),
        "embedded": (storage_root / "images" / "sha256").resolve(),
        None: None,
    }
    assert media_root(spec, tables, storage_root) == roots[expected]


def test_base64_broken_into_lines_decodes_to_the_same_image_in_bounded_memory() -> None:
    """A break every 4 characters (legal in base64) decodes to the same bytes, and the
    decode holds about two copies of the URL, not a string per line."""
    import tracemalloc

    payload = base64.b64encode(PNG * 2000).decode()  # ~150 KB of base64
    broken = "\n".join(payload[i : i + 4] for i in range(0, len(payload), 4))
    url = "data:image/png;base64,\r\n" + broken
    tracemalloc.start()
    found = extract_embedded_images({"image": url})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert found.record["image"] == _ref(PNG * 2000)
    assert peak < 4 * len(url), (peak, len(url))


def test_only_the_rows_kept_write_their_images(tmp_path: Path) -> None:
    """A row the filter drops, and one the subsample leaves out, write no image byte; the
    kept rows' images are all written, once; a killed load's staging is swept."""
    from mm_assets.common.files import temporary_name
    from mm_assets.registry import DatasetSpec
    from mm_assets.services.ingest import load_raw_dataset
    from mm_assets.storage import TableStore

    def url(i: int) -> str:
        return "data:image/png;base64," + base64.b64encode(PNG + bytes([i])).decode()

    def row(i: int, image: str) -> dict:
        turns = [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]
        return {"image": [image, url(i)], "conversations": turns}

    rows = [row(i, "coco/x.jpg" if i % 2 == 0 else "other/x.jpg") for i in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "store" / "images" / "sha256"
    live = store.parent / temporary_name("staging")  # a running load's (this pid)
    live.mkdir(parents=True)
    killed = store.parent / ".staging.999999999-0123456789abcdef0123456789abcdef.tmp"
    killed.mkdir()
    (killed / "x").write_bytes(b"half")
    spec = DatasetSpec(
        name="d",
        path=str(data),
        format="sharegpt4v",
        filter={"image_prefix": "coco/"},
        max_samples=5,
        seed=0,
    )
    tables = TableStore(tmp_path / "store")
    report = load_raw_dataset(spec, tables, store)
    kept = [json.loads(r["record"]) for r in tables.iter_rows("raw_dataset", "d")]
    assert len(kept) == 5 and report.rows_after_filter == 20
    wanted = {ref[len(EMBEDDED_PREFIX) :] for r in kept for ref in r["image"][1:]}
    on_disk = {p.name for p in store.rglob("*") if p.is_file()}
    assert on_disk == wanted and report.embedded_written == 5
    assert not killed.exists()
    assert [p for p in store.parent.iterdir() if p.name.startswith(".staging")] == [live]


def test_the_prune_job_removes_exactly_the_images_no_partition_references(
    tmp_path: Path,
) -> None:
    """Two loads of a partition with different rows leave the first load's other images
    behind: a dry run counts them, `apply` removes them (and only them), and a fresh one
    is kept while a load might still be writing its table."""
    from mm_assets.assets.maintenance import prune_embedded_images
    from mm_assets.assets.resources import StorageResource
    from mm_assets.registry import DatasetSpec
    from mm_assets.services.ingest import load_raw_dataset

    def url(i: int) -> str:
        return "data:image/png;base64," + base64.b64encode(PNG + bytes([i])).decode()

    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    data = tmp_path / "d.jsonl"
    storage = StorageResource(root=str(tmp_path / "root"))
    store, tables = storage.embedded_images_dir(), storage.tables()
    for first in (0, 3):  # rows 0-5, then rows 3-8: images 0-2 lose their last reference
        rows = [{"image": url(i), "conversations": turns} for i in range(first, first + 6)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        load_raw_dataset(DatasetSpec(name="d", path=str(data), format="sharegpt4v"), tables, store)
    stale = {hashlib.sha256(PNG + bytes([i])).hexdigest() for i in range(3)}
    assert len(list(store.glob("??/*"))) == 9

    def run(**config: object) -> set[str]:
        prune = {"ops": {"prune_embedded_images_op": {"config": config}}}
        assert prune_embedded_images.execute_in_process(
            run_config=prune, resources={"storage": storage}
        ).success
        return {p.name for p in store.glob("??/*")}

    assert len(run(apply=True)) == 9  # all younger than an hour
    _age(store.glob("??/*"))
    assert len(run()) == 9  # a dry run
    left = run(apply=True)
    assert len(left) == 6 and not (left & stale)


# -- pruning is safe by construction -------------------------------------------------


def _age(paths: Iterable[Path], hours: float = 2.0) -> None:
    """Files as old as a prune may remove."""
    then = time.time() - hours * 3600
    for path in paths:
        os.utime(path, (then, then))


def _loaded_store(tmp_path: Path, kept: int = 0) -> tuple[object, Path, list[str]]:
    """A storage root whose partition `d` references image `kept` of three stored ones,
    all of them old: the others are candidates for removal."""
    from mm_assets.assets.resources import StorageResource
    from mm_assets.registry import DatasetSpec
    from mm_assets.services.ingest import load_raw_dataset

    storage = StorageResource(root=str(tmp_path / "root"))
    store, tables = storage.embedded_images_dir(), storage.tables()
    data = tmp_path / "d.jsonl"
    spec = DatasetSpec(name="d", path=str(data), format="sharegpt4v")
    for i in (0, 1, 2, kept):  # each loaded once, the last load keeps image `kept`
        data.write_text(json.dumps(_image_row(i)) + "\n")
        load_raw_dataset(spec, tables, store)
    _age(store.glob("??/*"))
    return storage, store, [hashlib.sha256(_image(i)).hexdigest() for i in range(3)]


def _image(i: int) -> bytes:
    return PNG + bytes([i])


def _image_row(i: int) -> dict:
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    return {"image": _data_url(_image(i)), "conversations": turns}


def test_an_image_a_running_load_references_again_is_kept_and_made_young(
    tmp_path: Path,
) -> None:
    """An old stored image that no table names any more, taken again by a load still
    reading its rows, survives a prune; the load's commit gives it a fresh mtime, so it
    survives the prunes until the load's table names it."""
    from mm_assets.domain.ingest.sources import RawRow
    from mm_assets.services.embedded_store import prune_embedded_images
    from mm_assets.services.ingest import EmbeddedImageWriter

    storage, store, digests = _loaded_store(tmp_path)
    again = embedded_image_path(store, digests[1])
    writer = EmbeddedImageWriter(store)
    writer.take(RawRow(0, _image_row(1)))  # in flight: its table is not written yet
    prune_embedded_images(storage.tables(), store, apply=True)
    assert again.is_file()
    assert not embedded_image_path(store, digests[2]).exists()  # nobody's: removed
    writer.commit()
    assert again.read_bytes() == _image(1) and again.stat().st_mtime > time.time() - 60
    report = prune_embedded_images(storage.tables(), store, apply=True)
    assert again.is_file() and report.kept_young == 1


def test_a_stored_image_removed_while_a_load_holds_it_is_put_back_by_the_commit(
    tmp_path: Path,
) -> None:
    """A removal that checked before the load took the image (so it saw no reference)
    and unlinked after: the load's staged link keeps the bytes, its commit restores it."""
    from mm_assets.domain.ingest.sources import RawRow
    from mm_assets.services.ingest import EmbeddedImageWriter

    _, store, digests = _loaded_store(tmp_path)
    stored = embedded_image_path(store, digests[1])
    writer = EmbeddedImageWriter(store)
    writer.take(RawRow(0, _image_row(1)))
    stored.unlink()  # the racing removal
    writer.commit()
    assert stored.read_bytes() == _image(1) and writer.written == 1


@pytest.mark.parametrize(
    ("table", "row"),
    [
        ("normalized_conversations", lambda path: {"turns": json.dumps([{"path": str(path)}])}),
        ("target_responses", lambda path: {"turns": json.dumps([{"path": str(path)}])}),
        ("tokenized_samples", lambda path: {"messages": json.dumps([{"url": path.as_uri()}])}),
        ("coco_image_availability", lambda path: {"reference": "sha256:" + path.name}),
    ],
)
def test_an_image_a_benchmark_or_a_later_stage_names_is_kept(
    tmp_path: Path, table: str, row: object
) -> None:
    """A benchmark's prompts are read from its normalized conversations, and vLLM is sent
    the tokenized messages: an image named there is kept even when no raw row names it
    (the partition was loaded again since)."""
    from mm_assets.services.embedded_store import prune_embedded_images
    from mm_assets.storage import schemas

    storage, store, digests = _loaded_store(tmp_path)
    named = embedded_image_path(store, digests[1])
    schema = {
        "normalized_conversations": schemas.NORMALIZED,
        "target_responses": schemas.TARGET_RESPONSES,
        "tokenized_samples": schemas.TOKENIZED,
        "coco_image_availability": schemas.IMAGE_AVAILABILITY,
    }[table]
    storage.tables().write(table, "bench", [row(named)], schema)  # type: ignore[operator]
    report = prune_embedded_images(storage.tables(), store, apply=True)
    assert named.is_file() and report.removed == [embedded_image_path(store, digests[2])]


def test_an_empty_or_unreadable_catalog_removes_nothing(tmp_path: Path) -> None:
    """No table naming any image looks like "nothing referenced": refused with the
    reason; so is a table that cannot be read."""
    from mm_assets.assets.resources import StorageResource
    from mm_assets.services.embedded_store import prune_embedded_images
    from mm_assets.storage import schemas

    storage = StorageResource(root=str(tmp_path / "root"))
    store = storage.embedded_images_dir()
    old = embedded_image_path(store, hashlib.sha256(PNG).hexdigest())
    old.parent.mkdir(parents=True)
    old.write_bytes(PNG)
    _age([old])
    empty = prune_embedded_images(storage.tables(), store, apply=True)
    assert old.is_file() and not empty.removed
    assert "no table" in (empty.refused or "") and str(store) in (empty.refused or "")

    row = {"record": json.dumps({"image": "sha256:" + "0" * 64})}
    written = storage.tables().write("raw_dataset", "d", [row], schemas.RAW_DATASET)
    Path(written.path).write_bytes(b"not parquet")  # and its snapshot: the same file
    broken = prune_embedded_images(storage.tables(), store, apply=True)
    assert old.is_file() and "could not be read" in (broken.refused or "")


def test_a_reference_written_between_the_scan_and_the_removal_keeps_its_image(
    tmp_path: Path,
) -> None:
    """A load that writes its table after the prune's first read: the removal reads the
    references again and keeps the image."""
    from mm_assets.services.embedded_store import prune_embedded_images
    from mm_assets.storage import TableStore, schemas

    storage, store, digests = _loaded_store(tmp_path)
    late = {"record": json.dumps({"image": "sha256:" + digests[1]})}

    class WrittenMeanwhile(TableStore):  # another process, writing between two reads
        reads = 0

        def connect(self, wait_s: float = 10.0):  # type: ignore[no-untyped-def]
            self.reads += 1
            if self.reads == 2:
                self.write("raw_dataset", "late", [late], schemas.RAW_DATASET)
            return super().connect(wait_s)

    tables = WrittenMeanwhile(storage.tables().root)
    report = prune_embedded_images(tables, store, apply=True)
    assert embedded_image_path(store, digests[1]).is_file()
    assert report.kept_referenced_again == 1 and len(report.removed) == 1


def test_a_prune_younger_than_an_hour_is_refused_with_the_reason(tmp_path: Path) -> None:
    """`min_age_hours: 0` would remove the images a load committed a moment ago."""
    from mm_assets.assets.maintenance import prune_embedded_images as job

    storage, store, _ = _loaded_store(tmp_path)
    config = {"ops": {"prune_embedded_images_op": {"config": {"min_age_hours": 0, "apply": True}}}}
    with pytest.raises(Exception, match="use at least 1"):
        job.execute_in_process(run_config=config, resources={"storage": storage})
    assert len(list(store.glob("??/*"))) == 3
