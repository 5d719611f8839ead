"""What the real vLLM server opens: an image whose file name holds URL syntax is the file
the probe checked; an image outside the one directory it may open travels inline and is
answered the same; a file URL outside it is refused by vLLM itself; and a request
without this start's API key is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import openai
import pytest

from mm_assets.clients.vllm_generation import generate_greedy
from mm_assets.domain.prep.conversations import to_vllm_messages

pytestmark = pytest.mark.slow


def _turns(image: Path) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "path": str(image)},
                {"type": "text", "text": "Describe it."},
            ],
        }
    ]


def _ask(server, image: Path) -> list[int]:
    messages = to_vllm_messages(_turns(image))
    return generate_greedy(server.base_url, server.access, [messages], max_tokens=24)[0]


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
        assert _ask(plain_vllm_server, odd) == _ask(plain_vllm_server, original)
    finally:
        odd.unlink()
        decoy.unlink()


def test_an_image_outside_the_media_directory_goes_inline_and_vllm_cannot_open_it(
    demo_dir: Path, plain_vllm_server, tmp_path: Path
) -> None:
    """The server opens files under the image root only. A picture outside it (as the
    embedded-image store is when a partition also references files) is sent inline by
    the client and answered as under the root; the same file URL sent as is, bypassing
    the client, is refused by vLLM."""
    original = next((demo_dir / "coco").rglob("*.png"))
    outside = tmp_path / "elsewhere" / original.name
    outside.parent.mkdir()
    shutil.copyfile(original, outside)
    assert plain_vllm_server.access.media_dir == (demo_dir / "coco")
    assert _ask(plain_vllm_server, outside) == _ask(plain_vllm_server, original)
    client = openai.OpenAI(
        base_url=plain_vllm_server.base_url, api_key=plain_vllm_server.access.api_key
    )
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="allowed-local-media-path"):
        client.chat.completions.create(
            model=model, messages=to_vllm_messages(_turns(outside)), max_tokens=4
        )


def test_the_managed_server_answers_only_this_starts_key(plain_vllm_server) -> None:
    """No key, or a guessed one, gets 401 from the API, and from the routes vLLM's own
    key leaves open (`/invocations`, the SageMaker router, and `/tokenize`); the health
    probe and the counters stay open."""
    real = plain_vllm_server.access.api_key
    assert len(real) >= 32 and real not in " ".join(plain_vllm_server.command())
    for key in ("EMPTY", real[:-1]):
        client = openai.OpenAI(base_url=plain_vllm_server.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    model = openai.OpenAI(base_url=plain_vllm_server.base_url, api_key=real).models.list()
    body = {"model": model.data[0].id, "prompt": "Hello", "max_tokens": 2}
    keyed = {"Authorization": f"Bearer {real}"}
    with httpx.Client(base_url=plain_vllm_server.base_url.removesuffix("/v1")) as http:
        assert http.post("/invocations", json=body).status_code == 401
        assert http.post("/tokenize", json=body).status_code == 401
        assert http.post("/invocations", json=body, headers=keyed).status_code == 200
        assert http.get("/health").status_code == http.get("/metrics").status_code == 200
