"""A draft benchmarked per category on the real CPU vLLM, beside no speculation and vLLM's
n-gram method: one benchmark run (three servers) shared by the tests of this module.

n-gram lookup proposes what followed the last few tokens earlier in the context, so it is
accepted far more often when the answer is already in the prompt: the demo target, asked
a question a second time after its own answer to it, answers the same (`asked_again`),
while a first question's answer has words the prompt lacks (`first_ask`). A third
category has two rounds, the second quoting the target's own first answer.
The draft is the untrained EAGLE-3 checkpoint the trainer starts from (no training needed
to check that vLLM serves it and that decoding with it stays lossless).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mm_assets.clients.vllm_server import EngineOptions
from mm_assets.common.hashing import file_sha256
from mm_assets.domain.model.acceptance import OVERALL
from mm_assets.domain.model.benchmark import BenchmarkReport, combined
from mm_assets.domain.model.checkpoint import checkpoint_config
from mm_assets.domain.model.draft_vocab import build_draft_vocab
from mm_assets.domain.model.eagle3 import Eagle3Config, Eagle3Draft
from mm_assets.domain.model.hidden_states import default_layer_ids, text_config_facts
from mm_assets.domain.model.settings import BenchmarkSettings
from mm_assets.services.benchmarking import benchmark
from mm_assets.services.engine import DraftUnderTest, Serving, VllmEngine
from mm_assets.services.target import load_target_head
from mm_assets.services.training import save_checkpoint

pytestmark = pytest.mark.slow


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _asked_again(question: str, answer: str) -> list[dict]:
    """Two rounds of one question: the second is asked after the target's own first
    answer (the dataset's `answer` is dropped), so that answer is in the context."""
    return [_user(question), {"role": "assistant", "content": answer}, _user(question)]


CATEGORIES = {
    "asked_again": [
        _asked_again("How many sides does a hexagon have?", "A hexagon has six sides."),
        _asked_again(
            "What colour do you get when you mix red and blue?", "Mixing red and blue gives purple."
        ),
        _asked_again(
            "How many letters are in the word 'circle'?", "The word 'circle' has 6 letters."
        ),
    ],
    "first_ask": [
        [_user("How many sides does a pentagon have?")],
        [_user("What colour do you get when you mix blue and yellow?")],
        [_user("How many letters are in the word 'orange'?")],
    ],
    "two_rounds": [
        [
            {"role": "system", "content": "You are a patient maths tutor. Answer briefly."},
            _user("How many sides does a square have?"),
            {"role": "assistant", "content": "A square has four sides."},  # dropped
            _user("How many sides does a triangle have?"),
        ]
    ],
}
SETTINGS = BenchmarkSettings(max_tokens=24)
SPECULATIVE_TOKENS = 3


def untrained_draft(target_dir: Path, out_dir: Path, parallel: bool = False) -> DraftUnderTest:
    """The EAGLE-3 draft training starts from (`parallel`: P-EAGLE's, the target's last
    id as its mask token), written as a checkpoint vLLM loads."""
    config = json.loads((target_dir / "config.json").read_text())
    torch.manual_seed(0)
    cfg = Eagle3Config.from_target(config, draft_vocab_size=256)
    cfg = dataclasses.replace(cfg, mask_token_id=cfg.vocab_size - 1 if parallel else None)
    model = Eagle3Draft(cfg)
    head = load_target_head(target_dir)
    vocab = build_draft_vocab({t: 1 for t in range(cfg.vocab_size)}, cfg.vocab_size, 256)
    model.init_from_target(head.embed_tokens, head.lm_head, head.final_norm, vocab)
    layers = default_layer_ids(text_config_facts(config).num_layers)
    ckpt = checkpoint_config(
        cfg, layers[:3], str(target_dir), config["architectures"], SPECULATIVE_TOKENS, {}
    )
    save_checkpoint(model, ckpt, out_dir)
    return DraftUnderTest.at(out_dir)


@pytest.fixture(scope="module")
def setup(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    from mm_assets.clients import warm_servers

    root = tmp_path_factory.mktemp("benchmark")
    # no speculation's server, served again beside each later draft, is kept warm
    engine = VllmEngine(options=EngineOptions(dtype="float32", kv_cache_gib=1.0), keep_warm=1)
    target = demo_dir / "target"
    serving = Serving.for_target(engine, target, demo_dir / "coco", root / "logs" / "bench.log")
    draft = untrained_draft(target, root / "draft")
    yield {"args": (serving, CATEGORIES, draft, SETTINGS, root / "cache")}
    warm_servers.stop_all()


@pytest.fixture(scope="module")
def report(setup: dict) -> BenchmarkReport:
    started = time.perf_counter()
    report = benchmark(*setup["args"])
    setup["seconds"] = time.perf_counter() - started
    return report


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The serve arguments of every server a test's benchmark declares, joined."""
    declared: list[str] = []
    real_server = VllmEngine.server

    def counted(engine, model, serve_args, *rest):
        declared.append(" ".join(serve_args))
        return real_server(engine, model, serve_args, *rest)

    monkeypatch.setattr(VllmEngine, "server", counted)
    return declared


def _row(report: BenchmarkReport, category: str, method: str):
    return next(r for r in report.rows if r.category == category and r.method == method)


def test_ngram_acceptance_differs_per_category_and_combines_as_one_difference(
    report: BenchmarkReport,
) -> None:
    again, first = _row(report, "asked_again", "ngram"), _row(report, "first_ask", "ngram")
    assert again.acceptance_length > first.acceptance_length + 0.8, (again, first)
    overall = _row(report, OVERALL, "ngram")
    whole = report.runs["ngram@3"].whole_run  # one counter difference around every category
    assert overall.acceptance == whole.acceptance  # the replies' own counts add up to it
    assert (overall.requests, overall.output_tokens) == (whole.requests, whole.output_tokens)
    # the client waits for what vLLM times (arrival to finish), and a little more
    assert whole.latency_s <= overall.latency_s <= whole.latency_s + 0.25 * overall.requests
    per_category = [r for r in report.rows if r.method == "ngram" and r.category != OVERALL]
    assert overall == combined(per_category)
    assert overall.requests == 3 * 2 + 3 + 2  # two-round conversations ask twice


def test_every_request_is_a_record_and_every_row_carries_its_intervals(
    report: BenchmarkReport,
) -> None:
    """vLLM's reply gives each request its own counts (`--per-request-spec-decode-metrics`),
    so each row is the sum of its requests' records and has an interval over its prompts."""
    from mm_assets.domain.model.benchmark import comparison, figures_of, intervals, method_of

    records = [r for r in report.records if r.beside is None]
    assert len(records) == 3 * 11 and len({(r.method, r.prompt, r.round) for r in records}) == 33
    # no speculation's requests, sent in turn with each other method's, are its speed's pair
    none = [(r.prompt, r.round, r.latency_s) for r in records if r.method == "none"]
    for method in ("ngram@3", "eagle3@3"):
        beside = [r for r in report.runs[method].records if r.beside is not None]
        assert {r.beside for r in beside} == {method} and {r.method for r in beside} == {"none"}
        assert [(r.prompt, r.round, r.latency_s) for r in beside] == none  # one pass, shared
    for row in report.rows:
        mine = [r for r in records if r.method == row.method]
        mine = [r for r in mine if row.category in (OVERALL, r.category)]
        assert figures_of(row.category, method_of(row), mine) == row
        found = intervals(records, method_of(row), row.category)
        assert found.tokens_per_s.n == row.prompts
        assert found.tokens_per_s.low <= row.tokens_per_s <= found.tokens_per_s.high
        if row.method == "none":
            assert found.acceptance_length is None and found.speedup is None
            continue
        none_row = _row(report, row.category, "none")  # its own pass is the paired one here
        assert found.speedup.value == pytest.approx(row.tokens_per_s / none_row.tokens_per_s)
        assert report.speedup(row) == found.speedup.value
        if row.drafts:
            acceptance = found.acceptance_length
            assert acceptance.value == pytest.approx(row.acceptance_length)
            assert acceptance.low <= acceptance.value <= acceptance.high
    assert all(r.decode_s is not None and r.decode_s > 0 for r in records if r.output_tokens > 2)
    # every eagle3 reply drafted; n-gram's own counts differ per prompt
    assert all(r.acceptance.drafts > 0 for r in records if r.method == "eagle3")
    versus = comparison(records, (("ngram", 3), ("eagle3", 3)), OVERALL, "acceptance_length")
    ngram, draft = (_row(report, OVERALL, m).acceptance_length for m in ("ngram", "eagle3"))
    assert versus.value == pytest.approx(ngram / draft) and versus.n == 7


def test_every_method_is_timed_on_the_same_prompts_and_stays_lossless(
    report: BenchmarkReport,
) -> None:
    assert report.not_run == {}
    for method in ("none", "ngram", "eagle3"):
        for category in (*CATEGORIES, OVERALL):
            row = _row(report, category, method)
            assert row.tokens_per_s > 0 and row.mean_time_per_output_token_ms > 0, row
            assert row.output_tokens > 0 and row.latency_s > 0
        if method != "none":
            overall = _row(report, OVERALL, method)
            assert overall.drafts > 0
            assert overall.lossless == overall.compared == 11, (method, overall)
    # round 2 quotes the target's own first answer (from `none`), not the dataset's
    first_answer = report.runs["none"].answers["two_rounds"][0][0]
    second_prompt = report.prompts["two_rounds"][0][1]
    assert second_prompt[0]["role"] == "system"
    assert second_prompt[2] == {"role": "assistant", "content": first_answer.text}
    assert second_prompt[1]["content"] == CATEGORIES["two_rounds"][0][1]["content"]
    for method in ("ngram", "eagle3"):
        run = report.runs[f"{method}@3"]
        ids = [[a.token_ids for a in conv] for conv in run.answers["two_rounds"]]
        texts = [a.text for a in run.answers["two_rounds"][0]]
        assert ids == [[a.token_ids for a in report.runs["none"].answers["two_rounds"][0]]]
        assert texts[0] == first_answer.text


def test_a_rerun_with_the_same_inputs_starts_no_server(
    setup: dict, report: BenchmarkReport, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a rerun with unchanged inputs must not start a server")

    monkeypatch.setattr(VllmEngine, "server", refuse)
    again = benchmark(*setup["args"])
    assert again.reused == {"none": True, "ngram@3": True, "eagle3@3": True}
    assert again.rows == report.rows
    assert again.prompts == report.prompts


def test_another_draft_reuses_the_baselines_and_one_vllm_refuses_is_reported_not_run(
    setup: dict, report: BenchmarkReport, started: list[str]
) -> None:
    """A second draft on the same target and prompts starts only its own server; a
    draft vLLM cannot load is a row not run, with vLLM's reason, not a failed benchmark."""
    draft = setup["args"][2]
    broken = draft.dir.parent / "broken_draft"
    broken.mkdir()
    (broken / "config.json").write_text((draft.dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    args = list(setup["args"])
    args[2] = DraftUnderTest(broken, file_sha256(broken / "model.safetensors"), 3)
    again = benchmark(*args)
    # the draft's server, and no speculation's again to be sent in turn with it
    assert len(started) == 2 and str(broken) in started[1]
    assert "--speculative-config" not in started[0]
    assert again.reused == {"none": True, "ngram@3": True, "eagle3@3": False}
    assert "vLLM exited" in again.not_run["eagle3@3"]
    assert {r.method for r in again.rows} == {"none", "ngram"}
    cache = setup["args"][-1]  # what failed to start is not recorded: a rerun tries again
    assert len(list(cache.glob("benchmark_draft*.json"))) == 1


def test_depths_are_a_list_and_each_depth_is_served_once(
    setup: dict, report: BenchmarkReport, started: list[str]
) -> None:
    """`speculative_tokens: [1, 3]` measures the draft and n-gram at each depth, one
    server each. Depth 3 comes from the records the first run left (keyed without the
    list), so only depth 1's two servers start, and no speculation's again, sent in turn
    with them (its record stands). At depth 1 a step accepts one token at most, and
    decoding stays lossless."""
    args = list(setup["args"])
    args[3] = SETTINGS.model_copy(update={"speculative_tokens": [1, 3]})
    found = benchmark(*args)
    assert len(started) == 3 and "--speculative-config" not in started[0]
    assert all('"num_speculative_tokens": 1' in a for a in started[1:])
    assert found.reused == {
        "none": True, "ngram@1": False, "eagle3@1": False, "ngram@3": True, "eagle3@3": True
    }  # fmt: skip
    at_one = [r for r in found.rows if r.depth == 1]
    assert {r.method for r in at_one} == {"ngram", "eagle3"}
    for row in at_one:
        assert row.lossless == row.compared > 0
        assert len(row.acceptance.accepted_per_position) <= 1
        assert row.acceptance_length is None or row.acceptance_length <= 2.0
    assert [r for r in found.rows if r.depth in (None, 3)] == report.rows
    assert found.depth == 3 and found.shown == report.rows  # the draft's own depth first


def dflash_draft(target_dir: Path, out_dir: Path) -> DraftUnderTest:
    """A DFlash draft as training starts it (2 layers, the target's last id as the mask),
    written as the speculators `dflash` checkpoint vLLM loads."""
    from mm_assets.domain.model.checkpoint import draft_state
    from mm_assets.domain.model.dflash import DFlashDraft, dflash_config
    from mm_assets.domain.model.dflash_checkpoint import checkpoint_config as dflash_checkpoint
    from mm_assets.storage.checkpoints import write_checkpoint

    config = json.loads((target_dir / "config.json").read_text())
    vocab_size = int((config.get("text_config") or config)["vocab_size"])
    cfg = dflash_config(config, 256, mask_token_id=vocab_size - 1, num_layers=2)
    torch.manual_seed(0)
    model = DFlashDraft(cfg)
    head = load_target_head(target_dir)
    vocab = build_draft_vocab({t: 1 for t in range(cfg.vocab_size)}, cfg.vocab_size, 256)
    model.init_from_target(head.embed_tokens, head.lm_head, head.final_norm, vocab)
    layers = default_layer_ids(text_config_facts(config).num_layers)
    written = dflash_checkpoint(cfg, layers[:3], str(target_dir), config["architectures"], 3, {})
    write_checkpoint(out_dir, written, draft_state(model))
    return DraftUnderTest.at(out_dir)


OTHER_FAMILIES = {  # family: (its untrained checkpoint, what its server is started with)
    "dflash": (dflash_draft, '"method": "dflash"'),
    "peagle": (lambda target, out: untrained_draft(target, out, True), '"parallel_drafting": true'),
}


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_another_family_goes_through_the_same_benchmark_and_stays_lossless(
    setup: dict, report: BenchmarkReport, started: list[str], family: str
) -> None:
    """A DFlash checkpoint (speculators' `dflash`) and a P-EAGLE one (`peagle`: EAGLE-3's
    with a mask token and `mask_hidden`) written here load in vLLM 0.32 as their
    `speculators_model_type` says (`method: dflash`; `eagle3` with `parallel_drafting`),
    draft, and every greedy output stays the target's; n-gram comes from the first run's
    records, no speculation is served again beside each."""
    write, served_as = OTHER_FAMILIES[family]
    serving = setup["args"][0]
    draft = write(serving.target_dir, setup["args"][-1].parent / family)
    assert draft.method == family and draft.speculative_tokens == 3
    args = list(setup["args"])
    args[2] = draft
    found = benchmark(*args)
    assert len(started) == 2 and served_as in started[1]
    assert found.reused == {"none": True, "ngram@3": True, f"{family}@3": False}
    assert found.not_run == {} and found.draft_method == family
    overall = _row(found, OVERALL, family)
    assert overall.drafts > 0 and overall.lossless == overall.compared == 11


def test_vllm_serves_a_dflash_draft_beside_a_qwen3_vl_target_on_image_prompts(
    demo_dir: Path, tmp_path: Path
) -> None:
    """The DFlash checkpoint written for a Qwen3-VL-architecture target (interleaved
    M-RoPE, deepstack vision) names that verifier, keeps plain rope, and vLLM 0.32 serves
    it beside the target on image prompts, drafting (its acceptance on images is what
    BENCHMARKS.md's 'Draft families' discusses)."""
    from mm_assets.clients.vllm_generation import generate_greedy_replies
    from mm_assets.clients.vllm_server import ManagedVllmServer
    from tests.qwen3_vl_target import write_qwen3_vl_target

    target = write_qwen3_vl_target(demo_dir / "target", tmp_path / "qwen3_vl")
    draft = dflash_draft(target, tmp_path / "dflash")
    config = json.loads((draft.dir / "config.json").read_text())
    verifier = config["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "mrope" not in json.dumps(config["transformer_layer_config"])
    images = sorted((demo_dir / "coco" / "train2017").glob("*.jpg"))[:3]
    prompts = [
        [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"file://{image}"}},
            {"type": "text", "text": "What shapes are in this picture?"},
        ]}]
        for image in images
    ]  # fmt: skip
    options = EngineOptions(dtype="float32", kv_cache_gib=1.0)
    server = ManagedVllmServer(
        str(target), draft.serve_args(), demo_dir / "coco", tmp_path / "vllm.log", options
    )
    with server:
        replies = generate_greedy_replies(server.base_url, server.access, prompts, 24)
    assert all(0 < len(reply.token_ids) <= 24 for reply in replies)
    assert sum(reply.metrics.verifications for reply in replies) >= 3
