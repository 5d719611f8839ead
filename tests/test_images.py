"""Path confinement and header probing, on real files."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from mm_assets.domain.ingest.images import ImageStatus, probe_reference, resolve_reference
from tests.bad_inputs import png_declaring


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    root = tmp_path / "coco"
    (root / "train2017").mkdir(parents=True)
    noise = Image.effect_noise((64, 48), 60).convert("RGB")  # big scan data: cuts land in it
    noise.save(root / "train2017" / "a.jpg", quality=95)
    Image.new("RGB", (30, 20), "blue").save(root / "train2017" / "b.png")
    return root


def test_ok_images_report_header_facts(root: Path) -> None:
    jpg = probe_reference(root, "train2017/a.jpg")
    png = probe_reference(root, "coco/train2017/b.png", strip_prefix="coco/")
    assert jpg.status is ImageStatus.OK and (jpg.width, jpg.height, jpg.format) == (64, 48, "JPEG")
    assert png.status is ImageStatus.OK and (png.width, png.height, png.format) == (30, 20, "PNG")
    assert jpg.bytes == (root / "train2017" / "a.jpg").stat().st_size
    assert len(jpg.content_hash) == 64 and jpg.content_hash != png.content_hash


@pytest.mark.parametrize(
    "reference",
    ["../outside.jpg", "train2017/../../outside.jpg", "/etc/passwd", "file:///etc/hostname"],
)
def test_references_escaping_the_root_are_refused(root: Path, reference: str) -> None:
    (root.parent / "outside.jpg").write_bytes((root / "train2017" / "a.jpg").read_bytes())
    probe = probe_reference(root, reference)
    assert probe.status is ImageStatus.OUTSIDE_ROOT
    assert probe.path is None  # never opened


def test_symlink_pointing_out_is_refused_and_inside_is_followed(root: Path) -> None:
    outside = root.parent / "secret.jpg"
    Image.new("RGB", (8, 8)).save(outside)
    (root / "train2017" / "escape.jpg").symlink_to(outside)
    (root / "train2017" / "alias.jpg").symlink_to(root / "train2017" / "a.jpg")
    assert probe_reference(root, "train2017/escape.jpg").status is ImageStatus.OUTSIDE_ROOT
    assert probe_reference(root, "train2017/alias.jpg").status is ImageStatus.OK


def test_dotdot_staying_inside_is_allowed(root: Path) -> None:
    assert probe_reference(root, "train2017/../train2017/a.jpg").status is ImageStatus.OK


@pytest.mark.parametrize("reference", ["", "   ", None, 17, "http://example.com/a.jpg"])
def test_invalid_references(root: Path, reference: object) -> None:
    assert probe_reference(root, reference).status is ImageStatus.INVALID_REFERENCE


def test_missing_empty_truncated_and_not_an_image(root: Path) -> None:
    d = root / "train2017"
    (d / "empty.jpg").write_bytes(b"")
    full = (d / "a.jpg").read_bytes()
    (d / "cut.jpg").write_bytes(full[: len(full) // 2])
    png = (d / "b.png").read_bytes()
    (d / "cut.png").write_bytes(png[:-20])
    (d / "text.jpg").write_text("this is not an image")
    (d / "header_only.jpg").write_bytes(full[:10])
    expected = {
        "nope.jpg": ImageStatus.MISSING,
        "empty.jpg": ImageStatus.EMPTY,
        "cut.jpg": ImageStatus.UNREADABLE,
        "cut.png": ImageStatus.UNREADABLE,
        "text.jpg": ImageStatus.UNREADABLE,
        "header_only.jpg": ImageStatus.UNREADABLE,
    }
    got = {ref: probe_reference(root, f"train2017/{ref}").status for ref in expected}
    assert got == expected
    assert "truncated" in probe_reference(root, "train2017/cut.jpg").detail


def test_decompression_bombs_are_refused_without_decoding(root: Path) -> None:
    png_declaring(root / "train2017" / "bomb.png", 50_000, 50_000)  # 2.5 Gpx declared
    png_declaring(root / "train2017" / "big.png", 4_000, 3_000)
    assert probe_reference(root, "train2017/bomb.png").status is ImageStatus.TOO_LARGE
    big = probe_reference(root, "train2017/big.png", max_pixels=10_000_000)
    assert big.status is ImageStatus.TOO_LARGE and (big.width, big.height) == (4000, 3000)


def test_resolve_returns_real_path_inside_root(root: Path) -> None:
    resolved = resolve_reference(root, "train2017/a.jpg")
    assert isinstance(resolved, Path) and resolved == (root / "train2017" / "a.jpg").resolve()


def test_a_reference_holding_a_nul_byte_is_refused_not_raised(root: Path) -> None:
    probe = probe_reference(root, "train2017/a.jpg\x00.png")
    assert probe.status is ImageStatus.INVALID_REFERENCE and "NUL" in probe.detail


def test_a_file_over_the_byte_limit_is_refused_before_it_is_read(root: Path) -> None:
    padded = root / "train2017" / "padded.png"
    Image.new("RGB", (30, 20), "red").save(padded)
    size = padded.stat().st_size
    with open(padded, "ab") as fh:
        fh.write(b"\0" * 4096)  # after IEND: a reader would still take it whole
    probe = probe_reference(root, "train2017/padded.png", max_bytes=size + 1000)
    assert probe.status is ImageStatus.TOO_LARGE and probe.bytes == size + 4096
    assert "bytes > limit" in probe.detail and probe.width is None  # never opened
    assert probe_reference(root, "train2017/b.png", max_bytes=size + 1000).ok
