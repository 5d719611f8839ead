"""The Dagster UI in a real headless Chromium (Debian's, driven by Playwright), against
`dagster dev` with the repo's instance config: the graph shows the seven assets, a partition
materialized from the UI reaches SUCCESS, a plot in the metadata renders, and two
partitions backfilled together never extract hidden states at the same time."""

from __future__ import annotations

import contextlib
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
from tests.plots import PLOT_SIZE

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = REPO / "test-artifacts"
ASSETS = [
    "raw_dataset", "coco_image_availability", "normalized_conversations", "target_responses",
    "tokenized_samples", "hidden_states", "trained_speculator",
]  # fmt: skip
PARTITION = "demo_sharegpt4v_coco"
PARTITIONS = ["demo_sharegpt4v_coco", "demo_sharegpt"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ui_homes(prepared_demo, tmp_path_factory) -> tuple[Path, Path]:
    """A storage root holding the demo (linked) and the prep tables of both demo
    partitions (copied), but no hidden states; and a Dagster home with the repo's
    instance config in which `tokenized_samples` was materialized for PARTITION."""
    import dagster as dg

    from mm_assets.assets.resources import StorageResource
    from mm_assets.definitions import defs

    store, home = tmp_path_factory.mktemp("ui_store"), tmp_path_factory.mktemp("dagster_home")
    (store / "demo").symlink_to(SESSION_HOME / "demo")
    for table in (SESSION_HOME / "tables").iterdir():
        for partition in PARTITIONS:
            src = table / f"dataset={partition}" / "data.parquet"
            if src.is_file() and not table.name.startswith("hidden_states"):
                dest = store / "tables" / table.name / src.parent.name / src.name
                dest.parent.mkdir(parents=True)
                shutil.copyfile(src, dest)
    # the repo's instance config, without the automation daemon: these tests launch their
    # own runs, and automation must not start the chain (and its vLLM servers) meanwhile
    config = (REPO / "dagster.yaml").read_text() + "\nauto_materialize:\n  enabled: false\n"
    (home / "dagster.yaml").write_text(config)
    instance = dg.DagsterInstance.local_temp(str(home))  # a persistent one, at `home`
    dg.materialize(
        [defs.get_assets_def("tokenized_samples")],
        partition_key=PARTITION,
        resources={**defs.resources, "storage": StorageResource(root=str(store))},
        instance=instance,
    )
    return store, home


@pytest.fixture(scope="module")
def dagster_ui(ui_homes: tuple[Path, Path], vllm_server) -> str:
    """`dagster dev` on 127.0.0.1 over those homes; hidden states come from the session's
    vLLM server (external, as `MM_ASSETS_VLLM_URLS` configures)."""
    store, home = ui_homes
    port = _free_port()
    log = open(home / "dev.log", "wb")  # noqa: SIM115 - closed at teardown
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "MM_ASSETS_HOME": str(store),
        "MM_ASSETS_VLLM_URLS": vllm_server.base_url,
    }
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster"), "dev", "-w", "workspace.yaml",
         "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
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
    # `dagster dev` waits up to a minute for its daemon to finish its loops; its homes are
    # this module's, so after a short grace the whole group is killed.
    os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()


def _graphql(base: str, query: str) -> dict:
    request = urllib.request.Request(
        f"{base}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["data"]


def _runs(base: str, tag: str, value: str) -> list[dict]:
    """Runs carrying a tag, with their steps' status and times (GraphQL)."""
    query = f"""{{ runsOrError(filter: {{tags: [{{key: "{tag}", value: "{value}"}}]}}) {{
        ... on Runs {{ results {{
        runId status stepStats {{ stepKey status startTime endTime }} }} }} }} }}"""
    return _graphql(base, query)["runsOrError"]["results"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is missing; `make setup` installs it")
    ARTIFACTS.mkdir(exist_ok=True)
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=args)
        yield chromium
        chromium.close()


def _new_page(browser):
    """A page whose origin has seen Dagster's community dialog: on 127.0.0.1 it opens a
    second after load, over whatever the test clicks next (its "seen" mark is kept in
    local storage under `communityNux`)."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.add_init_script("window.localStorage.setItem('communityNux', JSON.stringify('1'))")
    return page


def _open(browser, url: str):
    page = _new_page(browser)
    page.goto(url, wait_until="networkidle")
    page.wait_for_timeout(1500)
    skip = page.get_by_role("button", name="Skip")  # the first-visit newsletter dialog
    if skip.count():
        skip.click()
    return page


def test_graph_and_materializing_a_partition_from_the_ui(dagster_ui: str, browser) -> None:
    page = _new_page(browser)
    seen = set()
    for group in ("ingest", "prep", "model"):
        page.goto(
            f"{dagster_ui}/locations/mm_assets/asset-groups/{group}", wait_until="networkidle"
        )
        page.wait_for_timeout(1500)
        text = page.inner_text("body")
        seen |= {name for name in ASSETS if name in text}
    assert seen == set(ASSETS)

    before = {r["runId"] for r in _runs(dagster_ui, "dagster/partition", PARTITION)}
    page = _open(browser, f"{dagster_ui}/assets/raw_dataset")
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
        new = [
            r for r in _runs(dagster_ui, "dagster/partition", PARTITION) if r["runId"] not in before
        ]
        status = new[0]["status"] if new else None
        if status in ("SUCCESS", "FAILURE", "CANCELED"):
            break
        time.sleep(2)
    page = _open(browser, f"{dagster_ui}/assets/raw_dataset")
    shot = ARTIFACTS / "ui_raw_dataset_materialized.png"
    page.screenshot(path=str(shot))
    print(f"screenshot: {shot}")
    assert status == "SUCCESS"


def test_a_metadata_plot_renders_in_the_ui(dagster_ui: str, browser) -> None:
    """The token-length histogram of the materialization the fixture made: a PNG the
    browser decodes at its full size."""
    page = _open(browser, f"{dagster_ui}/assets/tokenized_samples")
    row = page.locator("tr", has_text="token_lengths")
    row.get_by_text("[Show Markdown]").click()
    image = page.locator("img[src^='data:image/png']").first
    image.wait_for()
    size = image.evaluate("img => [img.complete, img.naturalWidth, img.naturalHeight]")
    page.screenshot(path=str(ARTIFACTS / "ui_token_length_plot.png"))
    assert size == [True, *PLOT_SIZE]


def _set_pool_limit(home: Path, limit: int) -> None:
    """The command a user runs to change the accelerator pool's limit."""
    dagster = str(Path(sys.executable).parent / "dagster")
    subprocess.run(
        [dagster, "instance", "concurrency", "set", "accelerator", str(limit)],
        env={**os.environ, "DAGSTER_HOME": str(home)},
        check=True,
        capture_output=True,
    )


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(3)
    pytest.fail(f"timed out waiting for {what}")


QUEUE_PASS = "Priority sorting and checking tag concurrency limits for queued runs"


def _queue_passes_since_held(dev_log: Path, run_ids: list[str]) -> int | None:
    """How many passes of the run queue began after it reported every run in `run_ids`
    held by the pool limits (its daemon logs into `dagster dev`'s log); None until then."""
    lines = dev_log.read_text(errors="replace").splitlines()
    held_at = []
    for run_id in run_ids:
        blocked = f"Run {run_id} is blocked by global concurrency limits"
        reported = [i for i, line in enumerate(lines) if blocked in line]
        if not reported:
            return None
        held_at.append(reported[0])
    return sum(QUEUE_PASS in line for line in lines[max(held_at) :])


def test_partitions_backfilled_together_never_extract_hidden_states_at_once(
    dagster_ui: str, ui_homes: tuple[Path, Path]
) -> None:
    """A backfill of `hidden_states` over both demo partitions while the accelerator pool
    is closed (limit 0): the daemon creates both runs and the queue holds them. Opened to
    1 (the repo's default), both are eligible at once and the pool lets one step through
    at a time (Dagster holds the other run in the queue or its step at the slot)."""
    home = ui_homes[1]
    _set_pool_limit(home, 0)
    names = ", ".join(f'"{p}"' for p in PARTITIONS)
    mutation = f"""mutation {{ launchPartitionBackfill(backfillParams: {{
        partitionNames: [{names}], assetSelection: [{{path: ["hidden_states"]}}],
        fromFailure: false }}) {{
        ... on LaunchBackfillSuccess {{ backfillId }} ... on PythonError {{ message }} }} }}"""
    launched = _graphql(dagster_ui, mutation)["launchPartitionBackfill"]
    assert "backfillId" in launched, launched
    backfill = launched["backfillId"]

    def statuses() -> list[str]:
        return sorted(r["status"] for r in _runs(dagster_ui, "dagster/backfill", backfill))

    _wait(lambda: statuses() == ["QUEUED", "QUEUED"], 300, "the backfill's two runs")
    # Proof that the queue holds them, not that it has not looked yet: its daemon reports
    # each run it holds for a pool (in the pass that would otherwise launch it); two passes
    # begun since then mean the first of them ended, and it held them again.
    queued = [r["runId"] for r in _runs(dagster_ui, "dagster/backfill", backfill)]

    def passes_since_held() -> int | None:
        return _queue_passes_since_held(home / "dev.log", queued)

    _wait(lambda: passes_since_held() is not None, 120, "the queue to hold both runs")
    _wait(lambda: (passes_since_held() or 0) >= 2, 120, "two more passes of the run queue")
    assert statuses() == ["QUEUED", "QUEUED"]
    _set_pool_limit(home, 1)

    def finished() -> list[dict] | None:
        runs = _runs(dagster_ui, "dagster/backfill", backfill)
        done = all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in runs)
        return runs if done else None

    runs = _wait(finished, 300, "both runs to finish")
    assert [r["status"] for r in runs] == ["SUCCESS", "SUCCESS"], runs
    steps = sorted(
        (s["startTime"], s["endTime"])
        for r in runs
        for s in r["stepStats"]
        if s["stepKey"] == "hidden_states"
    )
    assert len(steps) == 2
    (_, first_end), (second_start, _) = steps
    assert second_start >= first_end, f"two hidden_states steps overlapped: {steps}"
