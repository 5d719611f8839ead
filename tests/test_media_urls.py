"""An image whose file name holds URL syntax reaches the real vLLM server as the file the
probe checked, and the managed server runs with its narrowed environment."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mm_assets.clients.vllm_generation import generate_greedy
from mm_assets.domain.prep.conversations import to_vllm_messages

pytestmark = pytest.mark.slow


def _ask(url: str, image: Path) -> list[int]:
    turns = [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": str(image)},
                {"type": "text", "text": "Describe it."},
            ],
        }
    ]
    return generate_greedy(url, [to_vllm_messages(turns)], max_tokens=24)[0]


def test_a_file_name_with_url_syntax_is_the_file_vllm_reads(
    demo_dir: Path, plain_vllm_server
) -> None:
    """`#` would end the URL's path and `%41` would read as `A`: the picture under such a
    name gets the same greedy answer as under its plain name (a different picture, as a
    decoy under the name a wrong parse would open, does not)."""
    original = next((demo_dir / "coco").rglob("*.png"))
    odd = original.with_name("odd #1 %41.png")
    decoy = original.with_name("odd ")
    other = next(p for p in (demo_dir / "coco").rglob("*.png") if p != original)
    shutil.copyfile(original, odd)
    shutil.copyfile(other, decoy)
    try:
        url = plain_vllm_server.base_url
        assert _ask(url, odd) == _ask(url, original)
    finally:
        odd.unlink()
        decoy.unlink()
