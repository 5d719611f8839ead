"""Test session setup: an isolated storage root with the demo built once.

The environment is set in `pytest_configure`, before any test module is collected (and
so imports `mm_assets`), because the dataset registry (and so the partitions) is read
when the definitions load; `pytest_unconfigure` restores it and removes the root. A user
registry file adds a `bad_inputs` dataset (files written by its test), and the demo data
twice more: with a wrong image root, and as a partition whose tokens a test tampers with.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

SESSION_HOME: Path
"""The session's storage root (`MM_ASSETS_HOME`), made by `pytest_configure`."""
SESSION_INCOMING: Path
"""Where the session's extraction servers write (`MM_ASSETS_VLLM_CONNECTOR_DIR`)."""
FLEET_KEY = secrets.token_urlsafe(24)
"""The API key of the session's servers, which tests use as an external fleet: steps
read it from `MM_ASSETS_VLLM_API_KEY`, as a deployment's would."""
BAD_DIR: Path
"""Where `tests/bad_inputs.py` writes the `bad_inputs` dataset."""
_ENVIRONMENT = pytest.StashKey[pytest.MonkeyPatch]()


def pytest_configure(config: pytest.Config) -> None:
    global SESSION_HOME, SESSION_INCOMING, BAD_DIR
    SESSION_HOME = Path(tempfile.mkdtemp(prefix="mm_assets_test_"))
    SESSION_INCOMING = SESSION_HOME / "blobs" / "incoming" / "session_server"
    BAD_DIR = SESSION_HOME / "bad_inputs"
    env = config.stash[_ENVIRONMENT] = pytest.MonkeyPatch()
    env.setenv("MM_ASSETS_HOME", str(SESSION_HOME))
    env.setenv("DAGSTER_HOME", str(SESSION_HOME / "dagster_home"))
    env.setenv("MM_ASSETS_DATASETS", str(SESSION_HOME / "datasets.yaml"))
    env.delenv("MM_ASSETS_TARGET_MODEL", raising=False)
    env.delenv("COCO_DIR", raising=False)
    env.setenv("MM_ASSETS_VLLM_API_KEY", FLEET_KEY)
    env.setenv("MM_ASSETS_VLLM_CONNECTOR_DIR", str(SESSION_INCOMING))
    # the trained demo target: built once per user (as `make` keeps it), whatever the home
    cache_root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    cache = Path(cache_root) / "mm_assets" / "demo_targets"
    env.setenv("MM_ASSETS_DEMO_CACHE", os.environ.get("MM_ASSETS_DEMO_CACHE") or str(cache))
    (SESSION_HOME / "dagster_home").mkdir(parents=True)
    (SESSION_HOME / "datasets.yaml").write_text(_user_registry())


def pytest_unconfigure(config: pytest.Config) -> None:
    if _ENVIRONMENT in config.stash:
        config.stash[_ENVIRONMENT].undo()
        shutil.rmtree(SESSION_HOME, ignore_errors=True)


def _user_registry() -> str:
    # The demo partitions as the dataset wrote them keep the orchestration tests (UI, CLI,
    # pipeline, hidden states) off the generation pass; `demo_onpolicy` and `demo_regen*`
    # are the on-policy partitions (`responses: target`, as the shipped demo).
    return f"""
demo_sharegpt4v_coco:
  path: {SESSION_HOME}/demo/data/sharegpt4v_coco.json
  format: sharegpt4v
  filter: {{image_prefix: "coco/"}}
  image_root: {SESSION_HOME}/demo/coco
  image_path_strip_prefix: "coco/"
  seed: 0

demo_sharegpt:
  path: {SESSION_HOME}/demo/data/sharegpt.jsonl
  format: sharegpt
  seed: 0

demo_onpolicy:
  path: {SESSION_HOME}/demo/data/sharegpt4v_coco.json
  format: sharegpt4v
  image_root: {SESSION_HOME}/demo/coco
  image_path_strip_prefix: "coco/"
  max_samples: 96
  responses: target
  benchmarks: [demo_benchmark]

bad_inputs:
  path: {BAD_DIR}/data.json
  format: sharegpt4v
  image_root: {BAD_DIR}/coco
  image_path_strip_prefix: "coco/"
  min_image_availability: 0.0
  max_tokenization_quarantine_ratio: 0.5

bad_inputs_strict:
  path: {BAD_DIR}/data.json
  format: sharegpt4v
  image_root: {BAD_DIR}/coco
  image_path_strip_prefix: "coco/"
  min_image_availability: 0.0

empty_source:
  path: {SESSION_HOME}/edge/empty.jsonl
  format: sharegpt

all_quarantined:
  path: {SESSION_HOME}/edge/all_bad.jsonl
  format: sharegpt

demo_tampered:
  path: {SESSION_HOME}/demo/data/sharegpt4v_coco.json
  format: sharegpt4v
  image_root: {SESSION_HOME}/demo/coco
  image_path_strip_prefix: "coco/"

auto_text:
  path: {SESSION_HOME}/auto/sharegpt.jsonl
  format: sharegpt

demo_regen:
  path: {SESSION_HOME}/demo/data/sharegpt4v_coco.json
  format: sharegpt4v
  image_root: {SESSION_HOME}/demo/coco
  image_path_strip_prefix: "coco/"
  max_samples: 24
  responses: target

demo_regen_text:
  path: {SESSION_HOME}/demo/data/sharegpt.jsonl
  format: sharegpt
  max_samples: 24
  responses: target

embedded_mmstar:
  path: {SESSION_HOME}/embedded/mmstar.parquet
  format: prompts
  columns: {{prompt: question, image: image}}

embedded_adversarial:
  path: {SESSION_HOME}/embedded/adversarial
  data_files: [images.parquet, data_urls.jsonl]
  format: prompts
  columns: {{prompt: question, image: image}}
  min_image_availability: 0.0

trl_adversarial:
  path: {SESSION_HOME}/trl_adversarial/data.parquet
  format: messages
  role: benchmark
  category_column: category
  min_image_availability: 0.0

demo_wrong_root:
  path: {SESSION_HOME}/demo/data/sharegpt4v_coco.json
  format: sharegpt4v
  image_root: {SESSION_HOME}/no_such_root
  image_path_strip_prefix: "coco/"

drafts:
  # a draft of one capped source: benchmarked on its source's benchmark (draft_benchmark)
  onpolicy_capped:
    sources: {{demo_onpolicy: {{max_rows: 90}}}}
    speculator_benchmark: {{max_tokens: 32}}
"""


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The demo target and datasets, built once per test session."""
    from mm_assets.demo.__main__ import build

    return build()


@pytest.fixture(scope="session")
def demo_processor(demo_dir: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(demo_dir / "target")


PREP_ASSETS = [
    "raw_dataset",
    "coco_image_availability",
    "normalized_conversations",
    "target_responses",
    "tokenized_samples",
]


def materialize(
    partition: str,
    assets: list[str],
    resources: dict | None = None,
    raise_on_error: bool = True,
    run_config: dict | None = None,
):
    """Materialize some assets of the real definitions for one partition, in process."""
    import dagster as dg

    from mm_assets.definitions import defs

    return dg.materialize(
        [defs.get_assets_def(name) for name in assets],
        partition_key=partition,
        resources={**defs.resources, **(resources or {})},
        instance=dg.DagsterInstance.get(),
        raise_on_error=raise_on_error,
        run_config=run_config,
    )


@pytest.fixture(scope="session")
def prepared_demo(demo_dir: Path) -> dict:
    """The prep stages materialized once for both demo partitions."""
    return {p: materialize(p, PREP_ASSETS) for p in ("demo_sharegpt4v_coco", "demo_sharegpt")}


@pytest.fixture(scope="session")
def vllm_server(demo_dir: Path):
    """One real vLLM server (CPU engine) for the demo target, shared by the test run."""
    from mm_assets.clients.serve_args import extraction_args
    from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer
    from mm_assets.domain.model.hidden_states import default_layer_ids

    server = ManagedVllmServer(
        str(demo_dir / "target"),
        extraction_args(default_layer_ids(8), SESSION_INCOMING, "auto"),
        demo_dir / "coco",
        SESSION_HOME / "logs" / "session_vllm.log",
        EngineOptions(dtype="float32", kv_cache_gib=1.0),
        api_key=FLEET_KEY,
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def plain_vllm_server(demo_dir: Path):
    """A real vLLM server serving the demo target plainly (no extraction, no draft):
    target responses, and the reference for lossless speculative decoding."""
    from mm_assets.clients.vllm_server import EngineOptions, ManagedVllmServer

    server = ManagedVllmServer(
        str(demo_dir / "target"),
        [],
        demo_dir / "coco",
        SESSION_HOME / "logs" / "session_plain_vllm.log",
        EngineOptions(dtype="float32", kv_cache_gib=1.0),
        api_key=FLEET_KEY,
    )
    with server:
        yield server


ON_POLICY = {"max_tokens": 48, "max_response_quarantine_ratio": 0.5}


@pytest.fixture(scope="session")
def onpolicy_hidden_states(demo_dir: Path, plain_vllm_server, vllm_server) -> dict:
    """`demo_onpolicy` down to its hidden states: replies from the plain session server,
    hidden states from the extraction one."""
    from mm_assets.assets.resources import VllmResource

    fleets = VllmResource(
        base_urls=[vllm_server.base_url], response_urls=[plain_vllm_server.base_url]
    )
    run_config = {"ops": {"target_responses": {"config": ON_POLICY}}}
    materialize("demo_onpolicy", PREP_ASSETS, {"vllm": fleets}, run_config=run_config)
    return materialize("demo_onpolicy", ["hidden_states"], {"vllm": fleets})


@pytest.fixture(scope="session")
def demo_hidden_states(prepared_demo, vllm_server) -> dict:
    """hidden_states materialized for both demo partitions against the session server."""
    from mm_assets.assets.resources import VllmResource

    external = {"vllm": VllmResource(base_urls=[vllm_server.base_url])}
    return {
        p: materialize(p, ["hidden_states"], external)
        for p in ("demo_sharegpt4v_coco", "demo_sharegpt")
    }


SMALL_TEXT_RUN = """
ops:
  target_responses: {config: {max_tokens: 32}}
  trained_speculator: {config: {epochs: 3, measure_in_vllm: false}}
"""


@pytest.fixture(scope="session")
def clean_text_chain(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The text chain (`*trained_speculator` of `demo_regen_text`, small settings) run once
    through the CLI on the default executor: the reference for the chaos and distributed
    tests. Returns the chain, its storage root and how often each crash point was reached."""
    from bench.chaos import Chain, clean_run

    datasets = SESSION_HOME / "datasets.yaml"
    chain = Chain("demo_regen_text", run_config=SMALL_TEXT_RUN, datasets=datasets)
    clean, _, reached = clean_run(tmp_path_factory.mktemp("text_chain"), demo_dir, chain)
    return chain, clean, reached


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A real S3-compatible server (SeaweedFS) for the session; its client settings are in
    the environment while it runs, so subprocesses reach it too."""
    from tests.s3_server import seaweedfs

    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_bucket(s3_server) -> str:
    return s3_server.new_bucket()  # one: SeaweedFS gives each bucket volumes of its own


@pytest.fixture
def object_store_url(s3_bucket: str) -> str:
    """A prefix of the test's own in the session's bucket."""
    import uuid

    return f"s3://{s3_bucket}/{uuid.uuid4().hex[:8]}/mm_assets"
