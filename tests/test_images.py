"""Path confinement and header probing, on real files."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from mm_assets.domain.ingest.images import ImageStatus, probe_reference, resolve_reference
from mm_assets.services.target import TargetModel
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


def _rotated_jpeg(path: Path) -> None:
    """400 wide and 100 high as stored, with EXIF orientation 6 (shown turned a quarter)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (400, 100), "red").save(path, exif=exif.tobytes())


def test_the_probe_reports_what_vllm_will_see_or_refuses(root: Path) -> None:
    """An EXIF-turned JPEG is counted at its shown size (tokens are counted from it);
    a 16-bit PNG, which vLLM clips to white, and an EPS, which vLLM does not decode,
    are refused with their reasons."""
    _rotated_jpeg(root / "turned.jpg")
    Image.new("I;16", (8, 8)).save(root / "deep.png")
    Image.new("RGB", (8, 8), "blue").save(root / "page.eps")
    turned = probe_reference(root, "turned.jpg")
    assert turned.ok and (turned.width, turned.height) == (100, 400)
    deep = probe_reference(root, "deep.png")
    assert deep.status is ImageStatus.UNREADABLE and "clips them to white" in deep.detail
    eps = probe_reference(root, "page.eps")
    assert eps.status is ImageStatus.UNREADABLE and "format vLLM decodes" in eps.detail


@pytest.mark.slow
def test_the_probes_formats_and_turns_are_vllms(root: Path) -> None:
    """vLLM's own allow-list and its own orientation step (in a subprocess: importing
    vLLM takes ~10 s) agree with the probe."""
    import json
    import subprocess
    import sys

    from mm_assets.domain.ingest.images import VLLM_FORMATS

    _rotated_jpeg(root / "turned.jpg")
    code = (
        "import json, sys; from PIL import Image\n"
        "from vllm.multimodal.image import ALLOWED_IMAGE_FORMATS, normalize_image\n"
        "size = normalize_image(Image.open(sys.argv[1])).size\n"
        "print(json.dumps([list(ALLOWED_IMAGE_FORMATS), list(size)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root / "turned.jpg")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    formats, size = json.loads(out.strip().splitlines()[-1])
    assert sorted(formats) == sorted(VLLM_FORMATS)
    turned = probe_reference(root, "turned.jpg")
    assert [turned.width, turned.height] == size


def test_a_stored_image_must_be_a_plain_file_matching_its_name(tmp_path: Path) -> None:
    import hashlib

    from mm_assets.domain.ingest.embedded_images import embedded_image_path

    store = tmp_path / "store"
    good, other = tmp_path / "good.png", tmp_path / "other.png"
    Image.new("RGB", (4, 4), "red").save(good)
    Image.new("RGB", (4, 4), "blue").save(other)
    digest = hashlib.sha256(good.read_bytes()).hexdigest()
    path = embedded_image_path(store, digest)
    path.parent.mkdir(parents=True)
    path.write_bytes(good.read_bytes())
    assert probe_reference(tmp_path, f"sha256:{digest}", embedded_dir=store).ok
    path.write_bytes(other.read_bytes())  # changed since it was written
    changed = probe_reference(tmp_path, f"sha256:{digest}", embedded_dir=store)
    assert changed.status is ImageStatus.UNREADABLE and "do not match its name" in changed.detail
    path.unlink()
    path.symlink_to(good)  # the right bytes, but through a link out of the store
    linked = probe_reference(tmp_path, f"sha256:{digest}", embedded_dir=store)
    assert linked.status is ImageStatus.OUTSIDE_ROOT and "link" in linked.detail


# -- the default pixel cap follows the target's processor --------------------------------


def _target_with(tmp_path: Path, image_processor: object | None) -> TargetModel:
    """A target directory holding only an image processor's config (no weights): what
    the availability stage reads of it."""
    directory = tmp_path / "target"
    directory.mkdir(parents=True)
    if image_processor is not None:
        image_processor.save_pretrained(directory)  # type: ignore[attr-defined]
    return TargetModel(str(directory))


def test_the_default_pixel_cap_follows_the_target_processors_max_pixels(tmp_path: Path) -> None:
    """A Qwen2-VL-style processor keeping 100,000 pixels of an image gives a cap of 32x
    that; a setting wins; the cap never rises above Pillow's bomb threshold."""
    from transformers import Qwen2VLImageProcessor

    from mm_assets.domain.ingest.images import DEFAULT_MAX_PIXELS
    from mm_assets.services.ingest import pixel_cap

    target = _target_with(tmp_path, Qwen2VLImageProcessor(min_pixels=3136, max_pixels=100_000))
    cap, source = pixel_cap(None, target)
    assert cap == 3_200_000 and "100000" in source
    assert pixel_cap(5_000, target) == (5_000, "max_image_pixels (set)")
    png_declaring(tmp_path / "big.png", 2000, 2000)  # 4 MP: over the cap, under Pillow's
    assert probe_reference(tmp_path, "big.png", max_pixels=cap).status is ImageStatus.TOO_LARGE
    huge = Qwen2VLImageProcessor(min_pixels=3136, max_pixels=40_000_000)
    assert pixel_cap(None, _target_with(tmp_path / "huge", huge))[0] == DEFAULT_MAX_PIXELS


def test_the_demos_processor_admits_the_demos_largest_pictures(tmp_path: Path) -> None:
    """Processors scale larger images down: the demo's (140x140 kept) must not refuse
    its own 640x640 pictures, as a cap of exactly `max_pixels` would."""
    from transformers import Qwen2VLImageProcessor

    from mm_assets.demo.images import FIXED_SIZES
    from mm_assets.demo.target_training import TeachingSettings
    from mm_assets.services.ingest import pixel_cap

    kept = TeachingSettings().max_pixels
    target = _target_with(tmp_path, Qwen2VLImageProcessor(min_pixels=3136, max_pixels=kept))
    assert pixel_cap(None, target)[0] >= max(w * h for w, h in FIXED_SIZES) > kept


def test_a_processor_without_a_pixel_budget_keeps_pillows_cap(tmp_path: Path) -> None:
    """An edge length (Pixtral's `longest_edge`) is not a pixel budget, and a target
    without an image processor (text-only) says why it has none."""
    from transformers import PixtralImageProcessor

    from mm_assets.domain.ingest.images import DEFAULT_MAX_PIXELS
    from mm_assets.services.ingest import pixel_cap

    pixtral = _target_with(tmp_path / "pixtral", PixtralImageProcessor())
    assert pixel_cap(None, pixtral)[0] == DEFAULT_MAX_PIXELS
    cap, source = pixel_cap(None, _target_with(tmp_path / "text", None))
    assert cap == DEFAULT_MAX_PIXELS and "image processor" in source
