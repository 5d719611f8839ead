"""A draft benchmarked per category in vLLM, beside no speculation and vLLM's n-gram method.

Each method runs on a server of its own (`services/method_servers.py`). On CPU the
servers of a depth are up together and the methods are sent their requests in turn
(`services/method_runs.py`), so each speed-up pairs with the no-speculation requests
sent beside it (`PromptFigures.beside`); `none` stays up from one depth to the next. On
a GPU, which holds one server, each method runs alone, `none` first. `none`'s answers
are the target's: every method's later rounds quote them, and losslessness is checked
against its token ids. A warm-up request goes first (compilation is not the draft's
cost). The rows are sums of the requests' records.

Servers cost minutes, so figures are recorded under the cache directory: `none` and
`ngram` keyed by the target's content, the conversations, the settings and the engine
options (a second draft on the same benchmark starts no baseline server), the draft's
keyed by its weights too. A method vLLM refuses to start is reported as not run, with
vLLM's reason; `none` failing fails the benchmark (nothing to compare with).

A benchmark's prompts are its partition's normalized conversations (`role: benchmark`
entries are prepared like any dataset), by category (`load_benchmark`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mm_assets.clients.serve_args import ngram_args
from mm_assets.common.hashing import json_sha256
from mm_assets.domain.model.acceptance import Acceptance
from mm_assets.domain.model.benchmark import (
    BENCHMARK_VERSION,
    DEFAULT_DEPTH,
    NONE,
    OVERALL,
    Answer,
    BenchmarkConversation,
    BenchmarkFigures,
    BenchmarkReport,
    Generation,
    Method,
    MethodRun,
    PromptFigures,
    Turn,
    benchmark_conversation,
    capped,
    figures_of,
    label,
    round_prompt,
    same_generation,
    with_overall,
)
from mm_assets.domain.model.settings import BenchmarkSettings
from mm_assets.registry.specs import DEFAULT_CATEGORY
from mm_assets.services.engine import DraftUnderTest, Serving
from mm_assets.services.method_runs import run_methods
from mm_assets.services.method_servers import MethodServers
from mm_assets.services.target import target_fingerprint
from mm_assets.storage import TableStore
from mm_assets.storage.records import load_record, save_record

logger = logging.getLogger(__name__)


def all_prompts(
    conversations: list[BenchmarkConversation], answers: list[list[Answer]]
) -> list[list[list[Turn]]]:
    """Every round's prompt of each conversation, from the reference answers."""
    return [
        [round_prompt(conv, [a.text for a in done], k) for k in range(conv.rounds)]
        for conv, done in zip(conversations, answers, strict=True)
    ]


def _checked(run: MethodRun, reference: MethodRun, max_tokens: int) -> MethodRun:
    """The run's records marked lossless or not against the reference's token ids, and
    its figures summed again from them."""
    if run.not_run is not None:
        return run

    def same(r: PromptFigures) -> bool:
        ours, ref = (x.answers[r.category][r.conversation][r.round] for x in (run, reference))
        limited = (Generation.limited(a.token_ids, max_tokens) for a in (ours, ref))
        return same_generation(*limited)

    beside = [r for r in run.records if r.beside is not None]
    records = [replace(r, lossless=same(r)) for r in run.records if r.beside is None]
    method = (run.method, run.depth)
    figures = [
        figures_of(f.category, method, [r for r in records if r.category == f.category])
        for f in run.figures
    ]
    total = figures_of(OVERALL, method, records)
    whole = run.whole_run and replace(
        run.whole_run, lossless=total.lossless, compared=total.compared
    )
    return replace(run, figures=figures, records=records + beside, whole_run=whole)


def _figures_from_record(fields: dict[str, Any]) -> BenchmarkFigures:
    acceptance = Acceptance.from_record(fields["acceptance"])
    return BenchmarkFigures(**{**fields, "acceptance": acceptance})


def _from_record(fields: dict[str, Any]) -> MethodRun:
    whole = fields["whole_run"]
    return MethodRun(
        fields["method"],
        fields["depth"],
        [_figures_from_record(f) for f in fields["figures"]],
        {k: [[Answer(**a) for a in conv] for conv in v] for k, v in fields["answers"].items()},
        [
            PromptFigures(**{**r, "acceptance": Acceptance.from_record(r["acceptance"])})
            for r in fields["records"]
        ],
        _figures_from_record(whole) if whole else None,
        fields["not_run"],
        reused=True,
    )


def _plan(
    base_key: str,
    depths: list[int],
    draft: DraftUnderTest | None,
    settings: BenchmarkSettings,
    cache_dir: Path,
) -> dict[Method, tuple[str, list[str], Path]]:
    """Each method at each depth: its record's key, its serve arguments, its record. The
    `none` and n-gram records are keyed by the target, prompts and settings only, so a
    second draft on the same benchmark starts no baseline server."""
    lookup = (settings.prompt_lookup_min, settings.prompt_lookup_max)
    keys: dict[Method, tuple[str, list[str], str]] = {NONE: (base_key, [], "none")}
    for depth in depths:
        ngram = ngram_args(depth, *lookup)
        keys[("ngram", depth)] = (json_sha256([base_key, depth]), ngram, f"ngram{depth}")
        if draft is not None:
            key = json_sha256([base_key, draft.weights_sha256, depth])
            served = dataclasses.replace(draft, speculative_tokens=depth).serve_args()
            keys[(draft.method, depth)] = (key, served, f"draft{depth}")
    return {
        m: (key, args, cache_dir / f"benchmark_{name}_{key[:20]}.json")
        for m, (key, args, name) in keys.items()
    }


def _groups(
    depths: list[int],
    plan: dict[Method, tuple[str, list[str], Path]],
    recorded: dict[Method, MethodRun],
    together: bool,
) -> list[list[Method]]:
    """The methods measured together, in order. Servers up together (CPU): a depth at a
    time, `none` with each depth's unrecorded methods (at most three servers up), so
    every speed-up pairs with no speculation sent in turn with it. One at a time (a GPU
    holds one server): each method alone, `none` first."""
    todo = [m for m in plan if m != NONE and m not in recorded]
    if not together:
        return [[m] for m in ([] if NONE in recorded else [NONE]) + todo]
    if not todo:
        return [] if NONE in recorded else [[NONE]]
    groups = [[NONE, *(m for m in todo if m[1] == d)] for d in depths]
    return [g for g in groups if len(g) > 1]


def benchmark(
    serving: Serving,
    categories: dict[str, list[list[Turn]]],
    draft: DraftUnderTest | None,
    settings: BenchmarkSettings,
    cache_dir: Path,
    reuse: bool = True,
) -> BenchmarkReport:
    """Per category, the figures of `none`, `ngram` and (with a draft) `eagle3`, plus an
    `OVERALL` row per method (see the module's docstring)."""
    if not serving.engine.managed:
        raise ValueError(
            "benchmarking starts a server per method (none, ngram, eagle3) with its own "
            "--speculative-config; use a managed vllm resource (no base_urls) for it"
        )
    categories = capped(categories, settings.max_prompts_per_category)
    conversations = {
        name: [benchmark_conversation(turns) for turns in convs]
        for name, convs in categories.items()
    }
    depths = settings.speculative_tokens or [draft.speculative_tokens if draft else DEFAULT_DEPTH]
    fingerprint = target_fingerprint(serving.target_dir)
    options = serving.engine.options.model_dump()
    measured = settings.model_dump(exclude={"speculative_tokens"})
    base_key = json_sha256([BENCHMARK_VERSION, fingerprint, categories, measured, options])
    plan = _plan(base_key, depths, draft, settings, cache_dir)
    found = {m: (load_record(path, key) if reuse else None) for m, (key, _, path) in plan.items()}
    if found[NONE] is None:  # the others were checked against the recorded `none`
        found = dict.fromkeys(found)
    recorded = {m: _from_record(record) for m, record in found.items() if record}
    runs = {label(m): run for m, run in recorded.items()}
    with MethodServers(serving, settings.start_servers_together) as servers:
        for group in _groups(depths, plan, recorded, servers.together):
            servers.start({label(m): plan[m][1] for m in group if label(m) not in servers.servers})
            reference = runs.get("none")
            answers = reference.answers if reference else None
            for method, run in run_methods(
                group, servers, conversations, answers, settings
            ).items():
                if method == NONE and "none" in runs:
                    continue  # served again as the others' pair only: its first run stands
                reference = runs.get("none")
                run = _checked(run, reference, settings.max_tokens) if reference else run
                runs[label(method)] = run
                if run.not_run is None:  # a method vLLM did not start is tried again
                    key, _, path = plan[method]
                    save_record(path, key, asdict(run))
            for method in group:  # `none` stays up for the next depth's pairs
                if method != NONE or not servers.together:
                    servers.done(label(method))
    none = runs["none"]
    rows = with_overall([f for r in runs.values() for f in r.figures])
    prompts = {
        name: all_prompts(convs, none.answers[name]) for name, convs in conversations.items()
    }
    own = draft.speculative_tokens if draft and draft.speculative_tokens in depths else None
    return BenchmarkReport(rows, runs, prompts, own or depths[0])


@dataclass(frozen=True)
class BenchmarkSet:
    """One benchmark's conversations, by category (in the order categories first appear)."""

    name: str
    categories: dict[str, list[list[Turn]]]
    images: bool

    @property
    def conversations(self) -> int:
        return sum(len(c) for c in self.categories.values())


def load_benchmark(
    tables: TableStore, benchmark: str, per_category: int | None = None
) -> BenchmarkSet:
    """The benchmark partition's conversations by category, the first `per_category` of
    each (all when None). Fails with what to run when the benchmark is not prepared."""
    if not tables.exists("normalized_conversations", benchmark):
        raise FileNotFoundError(
            f"benchmark {benchmark!r} is not prepared: materialize its partition first "
            f"(`dagster asset materialize -m mm_assets.definitions --select "
            f"'+normalized_conversations' --partition {benchmark}`, or the prepare job)"
        )
    categories: dict[str, list[list[Turn]]] = {}
    images = False
    columns = ["turns", "category", "multimodal"]
    for row in tables.iter_rows("normalized_conversations", benchmark, columns):
        found = categories.setdefault(category_name(row["category"]), [])
        if per_category is None or len(found) < per_category:
            found.append(json.loads(row["turns"]))
            images = images or bool(row["multimodal"])
    return BenchmarkSet(benchmark, categories, images)


def category_name(stored: str | None) -> str:
    """The category a benchmark row is reported under: `overall` names the row that sums
    every category, so a category of that name is reported as `overall (category)`."""
    name = stored or DEFAULT_CATEGORY
    return f"{OVERALL} (category)" if name == OVERALL else name


def results_key(draft_sha256: str | None, benchmark: str, settings: Mapping[str, Any]) -> str:
    """What makes two measurements the same one: reruns of it replace its rows."""
    return json_sha256([draft_sha256, benchmark, dict(settings)])[:16]
