"""The Dagster UI in a real headless Chromium (Debian's, driven by Playwright): the graph
shows the six assets, and a partition materialized from the UI reaches SUCCESS."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import SESSION_HOME

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = REPO / "test-artifacts"
ASSETS = [
    "raw_dataset", "coco_image_availability", "normalized_conversations", "tokenized_samples",
    "hidden_states", "trained_speculator",
]  # fmt: skip
PARTITION = "demo_sharegpt4v_coco"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def dagster_ui(demo_dir: Path, tmp_path_factory) -> str:
    """`dagster dev` on 127.0.0.1 with its own instance (the repo's dagster.yaml)."""
    home = tmp_path_factory.mktemp("dagster_home")
    # the repo's instance config, without the automation daemon: this test launches its
    # own run, and automation must not start the chain (and its vLLM servers) meanwhile
    config = (REPO / "dagster.yaml").read_text() + "\nauto_materialize:\n  enabled: false\n"
    (home / "dagster.yaml").write_text(config)
    port = _free_port()
    log = open(home / "dev.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster"), "dev", "-w", "workspace.yaml",
         "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO,
        env={**os.environ, "DAGSTER_HOME": str(home), "MM_ASSETS_HOME": str(SESSION_HOME)},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/server_info", timeout=2):
                break
        except OSError:
            time.sleep(1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("dagster dev did not start:\n" + (home / "dev.log").read_text()[-3000:])
    yield base
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


def _graphql(base: str, query: str) -> dict:
    request = urllib.request.Request(
        f"{base}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["data"]


def _runs(base: str) -> list[dict]:
    where = f'tags: [{{key: "dagster/partition", value: "{PARTITION}"}}]'
    query = (
        f"{{ runsOrError(filter: {{{where}}}) {{ ... on Runs {{ results {{ runId status }} }} }} }}"
    )
    data = _graphql(base, query)
    return data["runsOrError"]["results"]


def test_graph_and_materializing_a_partition_from_the_ui(dagster_ui: str) -> None:
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is missing; `make setup` installs it")
    ARTIFACTS.mkdir(exist_ok=True)
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        seen = set()
        for group in ("ingest", "prep", "model"):
            page.goto(
                f"{dagster_ui}/locations/mm_assets/asset-groups/{group}", wait_until="networkidle"
            )
            page.wait_for_timeout(1500)
            text = page.inner_text("body")
            seen |= {name for name in ASSETS if name in text}
        assert seen == set(ASSETS)

        before = {r["runId"] for r in _runs(dagster_ui)}
        page.goto(f"{dagster_ui}/assets/raw_dataset", wait_until="networkidle")
        page.wait_for_timeout(1500)
        skip = page.get_by_role("button", name="Skip")  # the first-visit newsletter dialog
        if skip.count():
            skip.click()
        page.get_by_role("button", name="Materialize…").first.click()
        page.get_by_text("Launch runs to materialize raw_dataset").wait_for()
        page.wait_for_timeout(1000)  # the dialog animates in
        page.get_by_text("Select a partition or create one").click()
        page.keyboard.type(PARTITION)
        page.get_by_role("menuitem", name=PARTITION).first.click()
        page.keyboard.press("Escape")
        page.get_by_role("button", name="Launch 1 run").click()

        deadline = time.monotonic() + 240
        status = None
        while time.monotonic() < deadline:
            new = [r for r in _runs(dagster_ui) if r["runId"] not in before]
            status = new[0]["status"] if new else None
            if status in ("SUCCESS", "FAILURE", "CANCELED"):
                break
            time.sleep(2)
        page.goto(f"{dagster_ui}/assets/raw_dataset", wait_until="networkidle")
        page.wait_for_timeout(1500)
        shot = ARTIFACTS / "ui_raw_dataset_materialized.png"
        page.screenshot(path=str(shot))
        browser.close()
    print(f"screenshot: {shot}")
    assert status == "SUCCESS"
