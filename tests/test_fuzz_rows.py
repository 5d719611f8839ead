"""Generated rows, crafted ones among them, through ingest and normalization.

Hypothesis writes each example as a dataset file in every layout a reader takes: JSONL
(with undecodable lines among the records), a JSON list, and Parquet with image
structs. The rows are random JSON shapes, rows shaped like each format with junk in
every field, text with control characters and lone surrogates, nesting deeper than a
record may go, and images as random bytes, data URLs, forged hashes, NUL bytes, paths
out of the image root and links. Each example runs `raw_dataset`,
`coco_image_availability` and `normalized_conversations` on a real table store and
checks that:
- no exception escapes a stage;
- every input row is kept or quarantined with a reason;
- nothing is written outside the storage root.

`make test` runs `ROWS_PER_FORMAT` rows per format, derandomized so that a failure
reproduces. `make test-long` runs the `long` profile: four times the examples, a fresh
seed each run.
"""

from __future__ import annotations

import base64
import io
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from PIL import Image

from mm_assets.domain.ingest.sources import MAX_DEPTH
from mm_assets.registry import DatasetSpec
from mm_assets.registry.specs import PromptColumns
from mm_assets.services.ingest import load_raw_dataset, probe_dataset_images
from mm_assets.services.prep import normalize_partition
from mm_assets.storage import TableStore

ROWS_PER_FORMAT = 2000
EXAMPLES = 20  # of at least 100 rows: ROWS_PER_FORMAT per format, counted below
COLUMNS = PromptColumns(prompt="question", image="image", answer="answer")


def _png(size: tuple[int, int] = (4, 3)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, "PNG")
    return buffer.getvalue()


PNG = _png()

# -- strategies --------------------------------------------------------------------

# every code point, lone surrogates and control characters included
text = st.text(st.characters(exclude_categories=()), max_size=24) | st.sampled_from(
    ["", " ", "<image>", "<image>\n<image>", "\x00", "\ud800", "data:image/png;base64,AAAA"]
)
# images as a row may hold them: the dataset's files, paths that leave the image root,
# random bytes, data URLs of random or real pictures, forged hash references
image_ref = st.one_of(
    st.sampled_from(
        [
            "a.png",
            "sub/b.png",
            "missing.png",
            "../outside.png",
            "/etc/passwd",
            "link_out.png",
            "a\x00.png",
            "sha256:" + "0" * 64,
            "sha256:zz",
            "file:///etc/passwd",
            "data:image/png;base64," + base64.b64encode(PNG).decode(),
            "data:image/png;base64,!!!!",
            "data:image/png;base64,\n" + "\n".join(base64.b64encode(PNG).decode()),
        ]
    ),
    text,
    st.binary(max_size=64).map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode()),
)
image_value = st.one_of(
    image_ref,
    st.lists(image_ref, max_size=3),
    st.fixed_dictionaries({"bytes": st.binary(max_size=64) | st.just(PNG), "path": text}),
    st.builds(lambda b: {"bytes": b}, st.binary(max_size=32)),
)
number = st.integers() | st.floats(allow_nan=False, allow_infinity=False)  # JSON has no inf
json_scalar = st.none() | st.booleans() | number | text
json_value = st.recursive(
    json_scalar | image_value,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
role = st.sampled_from(["human", "gpt", "user", "assistant", "system", "tool", "x"]) | text
content = st.one_of(
    text,
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": text}),
            st.fixed_dictionaries({"type": st.just("image")}),
            st.fixed_dictionaries({"type": st.just("image"), "image": image_ref}),
            st.fixed_dictionaries(
                {
                    "type": st.just("image_url"),
                    "image_url": st.fixed_dictionaries({"url": image_ref}),
                }
            ),
            json_value,
        ),
        max_size=4,
    ),
    json_value,
)
sharegpt_turn = st.fixed_dictionaries({"from": role, "value": text | json_value})
message = st.fixed_dictionaries({"role": role, "content": content})
# a question and its answer, so that some rows are valid
said = st.text(st.characters(exclude_categories=()), min_size=1, max_size=24)
exchange = st.tuples(said, said).map(
    lambda qa: [{"from": "human", "value": qa[0]}, {"from": "gpt", "value": qa[1]}]
)
turns = st.lists(sharegpt_turn, max_size=5) | exchange
chat = exchange.map(
    lambda t: [
        {"role": "user", "content": t[0]["value"]},
        {"role": "assistant", "content": t[1]["value"]},
    ]
)
FORMAT_ROWS = {
    "sharegpt": st.fixed_dictionaries({"conversations": turns}),
    "sharegpt4v": st.fixed_dictionaries({"image": image_value, "conversations": turns}),
    "messages": st.fixed_dictionaries(
        {"messages": st.lists(message, max_size=5) | chat}, optional={"images": image_value}
    ),
    "prompts": st.fixed_dictionaries(
        {"question": text | st.lists(text, max_size=3) | json_value},
        optional={"image": image_value, "answer": text | st.lists(text, max_size=3)},
    ),
}


class Deep:
    """A row nested `levels` deep, written as text (Python's own JSON writer, and
    Hypothesis' printer, would recurse through it)."""

    def __init__(self, levels: int) -> None:
        self.levels = levels

    def __repr__(self) -> str:
        return f"Deep({self.levels})"

    def json(self) -> str:
        return '{"conversations": ' + "[" * self.levels + '"x"' + "]" * self.levels + "}"


def rows_for(fmt: str) -> st.SearchStrategy[list[Any]]:
    """Rows of a format, some of any JSON shape, some nested too deep."""
    row = st.one_of(
        FORMAT_ROWS[fmt],
        FORMAT_ROWS[fmt],
        json_value,
        st.sampled_from([MAX_DEPTH + 1, 900, 5000]).map(Deep),
    )
    return st.lists(row, min_size=100, max_size=120)


# -- running the stages ------------------------------------------------------------


def _json(row: Any) -> str:
    """A row as an export writes it: bytes as base64, lone surrogates escaped."""
    if isinstance(row, Deep):
        return row.json()
    return json.dumps(row, default=lambda b: base64.b64encode(b).decode())


def _files(directory: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def _dataset_dir(root: Path) -> Path:
    """The image root beside the data: two pictures, and a link out of it."""
    images = root / "images"
    (images / "sub").mkdir(parents=True)
    (images / "a.png").write_bytes(PNG)
    (images / "sub" / "b.png").write_bytes(_png((3, 5)))
    (root / "outside.png").write_bytes(PNG)
    (images / "link_out.png").symlink_to(root / "outside.png")
    return images


def run_stages(fmt: str, layout: str, rows: list[Any], junk_lines: list[bytes]) -> Counter[str]:
    """The three stages on `rows` written in `layout`; returns the counts checked."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        images = _dataset_dir(root)
        data, expected = root / f"data.{layout}", len(rows)
        if layout == "jsonl":
            lines = [_json(r).encode() for r in rows]
            for i, junk in enumerate(junk_lines):
                lines.insert((i * 7) % (len(lines) + 1), junk)
            expected += sum(bool(j.strip()) for j in junk_lines)
            data.write_bytes(b"\n".join(lines) + b"\n")
        elif layout == "json":
            data.write_text("[" + ", ".join(map(_json, rows)) + "]")
        else:
            data.write_bytes(_parquet(rows))
        spec = DatasetSpec(
            name="fuzz",
            path=str(data),
            format=fmt,
            image_root=str(images),
            columns=COLUMNS if fmt == "prompts" else PromptColumns(),
        )
        store = root / "store"
        before = _files(root)
        tables = TableStore(store)
        raw = load_raw_dataset(spec, tables, store / "images")
        probe_dataset_images(spec, tables, 10**7, store / "images")
        normalized = normalize_partition(spec, tables)
        after = {p: s for p, s in _files(root).items() if not p.startswith(str(store) + os.sep)}
        assert after == before, "a stage wrote outside the storage root"
        assert raw.written.num_rows == expected
        assert normalized.kept.num_rows + normalized.quarantine.num_rows == expected
        reasons = [
            (q["reason"], q["detail"])
            for q in tables.iter_rows("normalized_conversations_quarantine", "fuzz")
        ]
        assert all(reason and detail for reason, detail in reasons), reasons
        return Counter(rows=expected, kept=normalized.kept.num_rows)


PARQUET_SCHEMA = pa.schema(
    [
        ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
    ]
)


def _utf8(value: Any) -> str | None:
    """A string Parquet can hold (a lone surrogate cannot be written)."""
    if not isinstance(value, str):
        return None if value is None else _json(value)
    return value.encode("utf-8", "replace").decode("utf-8")


def _parquet(rows: list[Any]) -> bytes:
    """The rows as a Hub image dataset stores them: an image struct, turns as structs."""
    records = []
    for row in rows:
        row = row if isinstance(row, dict) else {"conversations": None}
        image = row.get("image")
        image = image if isinstance(image, dict) else {"bytes": None, "path": image}
        turns = row.get("conversations")
        turns = turns if isinstance(turns, list) else []
        records.append(
            {
                "image": {
                    "bytes": image.get("bytes") if isinstance(image.get("bytes"), bytes) else None,
                    "path": _utf8(image.get("path")),
                },
                "conversations": [
                    {"from": _utf8(t.get("from")), "value": _utf8(t.get("value"))}
                    for t in turns
                    if isinstance(t, dict)
                ],
            }
        )
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records, schema=PARQUET_SCHEMA), buffer)
    return buffer.getvalue()


# -- the tests ---------------------------------------------------------------------

settings.register_profile(
    "default",
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: an example is 100 rows
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LONG = 4  # times the examples of `make test` (a fresh seed each run)
settings.register_profile(
    "long",
    max_examples=EXAMPLES * LONG,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LAYOUTS = {"sharegpt": "jsonl", "sharegpt4v": "parquet", "messages": "jsonl", "prompts": "json"}
junk = st.lists(st.binary(max_size=40).filter(lambda b: b"\n" not in b), max_size=4)


def _fuzz(fmt: str, profile: str) -> Counter[str]:
    totals: Counter[str] = Counter()

    @settings(settings.get_profile(profile))
    @given(rows=rows_for(fmt), junk_lines=junk)
    def examples(rows: list[Any], junk_lines: list[bytes]) -> None:
        layout = LAYOUTS[fmt] if fmt != "sharegpt4v" or len(rows) % 2 else "jsonl"
        totals.update(run_stages(fmt, layout, rows, junk_lines if layout == "jsonl" else []))

    examples()
    return totals


@pytest.mark.parametrize("fmt", sorted(FORMAT_ROWS))
def test_generated_rows_are_kept_or_quarantined_never_raised(fmt: str) -> None:
    totals = _fuzz(fmt, "default")
    assert totals["rows"] >= ROWS_PER_FORMAT, totals
    assert totals["kept"] > 0, "no generated row was ever valid: the generator is too narrow"


@pytest.mark.long
@pytest.mark.parametrize("fmt", sorted(FORMAT_ROWS))
def test_generated_rows_long_profile(fmt: str) -> None:
    assert _fuzz(fmt, "long")["rows"] >= ROWS_PER_FORMAT * LONG
