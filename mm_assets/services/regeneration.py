"""Target responses for a partition: every assistant turn rewritten by the target through
vLLM (`responses: target`), or the normalized conversations passed through (`dataset`).

Replies are stored per conversation under a content key (`response_key`) once it is
done, so a rerun sends nothing for unchanged conversations and an interrupted run
resumes. Generation errors that may be passing are not stored: the next run asks again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from mm_assets.clients.vllm_client import RequestRefused
from mm_assets.clients.vllm_generation import ChatClient
from mm_assets.domain.model.responses import (
    Regeneration,
    Reply,
    ResponseProblem,
    ResponseRejected,
    ResponseSettings,
    check_reply,
    prompt_before,
    refusal_problem,
    regenerated_turns,
    response_key,
    with_system_prompt,
)
from mm_assets.domain.prep.conversations import reply_indices, to_vllm_messages
from mm_assets.domain.prep.tokenization import count_images
from mm_assets.services.engine import VllmEngine
from mm_assets.services.prep import StageReport
from mm_assets.services.request_stage import Outcome, RequestReport, Stored, Unusable, run_stage
from mm_assets.services.target import TargetModel
from mm_assets.storage import TableStore, schemas
from mm_assets.storage.blobs import BlobStore

SOURCE = "normalized_conversations"
TABLE = "target_responses"
IMAGE_COLUMNS = ("image_paths", "image_hashes", "image_heights", "image_widths")
logger = logging.getLogger(__name__)


@dataclass
class RegenerationReport(StageReport):
    mode: str = "dataset"
    conversations: int = 0
    cache_hits: int = 0
    requests: RequestReport = field(default_factory=RequestReport)
    server: str = ""
    reply_lengths: list[int] = field(default_factory=list)
    length_capped: int = 0
    cut_short: int = 0  # conversations kept up to the turn before a failed or empty reply


def _passthrough(row: dict[str, Any]) -> dict[str, Any]:
    return {
        **row,
        "responses": "dataset",
        "response_key": None,
        "reply_turns": [],
        "reply_token_ids": [],
        "finish_reasons": [],
    }


@dataclass(frozen=True)
class TargetRegeneration:
    partition: str
    tables: TableStore
    store: BlobStore
    target: TargetModel
    engine: VllmEngine
    settings: ResponseSettings
    image_root: Path | None
    log_path: Path

    def run(self, mode: str) -> RegenerationReport:
        """`mode` is the dataset's `responses` entry: `target` or `dataset`."""
        report = RegenerationReport(mode=mode, server=self._engine.describe())
        if mode == "dataset":
            rows = (_passthrough(r) for r in self.tables.iter_rows(SOURCE, self.partition))
            report.kept = self.tables.write(TABLE, self.partition, rows, schemas.TARGET_RESPONSES)
            report.quarantine = self.tables.write(
                f"{TABLE}_quarantine", self.partition, [], schemas.QUARANTINE
            )
            report.conversations = report.kept.num_rows
            return report
        columns = ["sample_id", "turns", "image_hashes"]
        keys = {row["sample_id"]: self._key(row) for row in self._rows(columns)}
        missing = {sid for sid, key in keys.items() if not self.store.has(key)}
        report.conversations, report.cache_hits = len(keys), len(keys) - len(missing)
        logger.info(
            "%d conversations: %d cached, %d to ask", len(keys), report.cache_hits, len(missing)
        )
        unstored: dict[str, Regeneration] = {}
        if missing:
            job = ReplyJob(keys, self.store, self.settings, self._turns, unstored)
            rows = (r for r in self._rows() if r["sample_id"] in missing)
            model, engine = str(self.target.local_dir), self._engine
            session = engine.session(model, [], self.image_root, self.log_path)
            report.requests = run_stage(session, self.settings, ChatClient, job, rows, len(missing))
        self._write_table(keys, unstored, report)
        return report

    def _rows(self, columns: list[str] | None = None) -> Iterator[dict[str, Any]]:
        return self.tables.iter_rows(SOURCE, self.partition, columns)

    def _turns(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        return with_system_prompt(json.loads(row["turns"]), self.settings.system_prompt)

    @cached_property
    def _engine(self) -> VllmEngine:
        """Served at the dtype extraction and measurement use, so the replies are the
        greedy continuations the deployed target writes (bf16 and fp32 differ)."""
        return self.engine.for_target(self.target.facts)

    def _key(self, row: dict[str, Any]) -> str:
        turns = json.loads(row["turns"])
        return response_key(
            self.target.fingerprint,
            self._engine.options.dtype,
            self.settings,
            turns,
            row["image_hashes"],
        )

    def _write_table(
        self, keys: dict[str, str], unstored: dict[str, Regeneration], report: RegenerationReport
    ) -> None:
        with (
            self.tables.writer(TABLE, self.partition, schemas.TARGET_RESPONSES) as out,
            self.tables.writer(f"{TABLE}_quarantine", self.partition, schemas.QUARANTINE) as bad,
        ):
            for row in self._rows():
                key = keys[row["sample_id"]]
                stored = self.store.get_json(key)
                regeneration = (
                    Regeneration.from_json(stored) if stored else unstored[row["sample_id"]]
                )
                try:
                    out.write(self._regenerated_row(row, key, regeneration, report))
                except ResponseRejected as exc:
                    report.reject(bad, row["source_index"], row["sample_id"], row["turns"], exc)
        report.kept, report.quarantine = out.result, bad.result

    def _regenerated_row(
        self, row: dict[str, Any], key: str, regeneration: Regeneration, report: RegenerationReport
    ) -> dict[str, Any]:
        turns = self._turns(row)
        kept = regenerated_turns(turns, regeneration)
        report.cut_short += len(kept) < len(turns)
        report.reply_lengths += [len(r.token_ids) for r in regeneration.replies]
        report.length_capped += sum(r.finish_reason == "length" for r in regeneration.replies)
        images = count_images(kept)
        return {
            **row,
            "turns": json.dumps(kept, ensure_ascii=False),
            "multimodal": images > 0,
            **{k: row[k][:images] for k in IMAGE_COLUMNS},
            "responses": "target",
            "response_key": key,
            "reply_turns": [r.index for r in regeneration.replies],
            "reply_token_ids": [r.token_ids for r in regeneration.replies],
            "finish_reasons": [r.finish_reason for r in regeneration.replies],
        }


@dataclass(frozen=True)
class ReplyJob:
    """A conversation's replies asked turn by turn (`regenerate`), stored under its key
    once it is done. A generation error (maybe passing) is not stored, so the next run
    asks again; this run keeps it in `unstored` for the table."""

    keys: dict[str, str]
    store: BlobStore
    settings: ResponseSettings
    turns: Callable[[dict[str, Any]], list[dict[str, Any]]]
    unstored: dict[str, Regeneration]
    what = "conversations"
    kept = "Conversations answered so far are kept"
    ask_again = 0
    # a conversation holds its worker through its turns: twice the workers keep
    # `concurrency` requests in flight while some wait between turns or finish
    workers_per_slot = 2

    async def ask(self, client: ChatClient, row: dict[str, Any]) -> Regeneration:
        return await regenerate(client, self.turns(row), self.settings)

    def write(self, row: dict[str, Any], answer: Regeneration | Exception, final: bool) -> Outcome:
        if isinstance(answer, Exception):  # not raised by `regenerate`; defensive
            answer = Regeneration([], ResponseProblem.GENERATION_ERROR, str(answer))
        tokens = sum(len(r.token_ids) for r in answer.replies)
        sample_id = row["sample_id"]
        if answer.problem == ResponseProblem.GENERATION_ERROR:
            self.unstored[sample_id] = answer  # one key per conversation
            return Unusable(sample_id, answer.problem.value, answer.detail, tokens)
        path = self.store.put_json(answer.as_json(), self.keys[sample_id])
        return Stored(tokens, path.stat().st_size)


async def regenerate(
    client: ChatClient, turns: list[dict[str, Any]], settings: ResponseSettings
) -> Regeneration:
    """The target's replies to a conversation, turn by turn, until the end or the first
    reply that fails or comes back empty."""
    regeneration = Regeneration()
    for index in reply_indices(turns):
        messages = to_vllm_messages(prompt_before(turns, index, regeneration.replies))
        try:
            answer = await client.reply(messages, settings.sampling())
            check_reply(answer.text, answer.finish_reason)
        except RequestRefused as exc:
            regeneration.problem = refusal_problem(exc.status, str(exc))
            regeneration.detail = f"turn {index}: {exc}"
            break
        except ResponseRejected as exc:
            regeneration.problem = ResponseProblem(exc.reason)
            regeneration.detail = f"turn {index}: {exc.detail}"
            break
        regeneration.replies.append(
            Reply(index, answer.text, answer.token_ids, answer.finish_reason)
        )
    return regeneration
