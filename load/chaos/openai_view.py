"""The OpenAI part of ``fleetbatch loadgen chaos``: batches through the HTTP front, and the user's view of them.

:class:`OpenAIBatches` uploads input files, creates batches, waits for them and downloads
their output and error files with the ``openai`` client (as ``fleetbatch loadgen openai-check`` does).
:func:`user_view` checks what a user reads: every ``custom_id`` exactly once across the output
and error files, ``request_counts`` equal to those lines, ``usage`` the sum of the output
lines' usage, and no error line for a row that could have run.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from gateway.http_api.format import CHAT
from load.chaos.waves import legit_failure
from load.soaks.openai_check import FINAL, batch_problems, input_rows
from load.workload import WorkItem

log = logging.getLogger(__name__)


@dataclass
class OpenAIRun:
    """One OpenAI batch of the run: its input rows, and once read, its final object and files."""

    name: str
    rows: list[dict]
    batch_id: str = ""
    batch: object | None = None
    output: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    problem: str = ""  # why it could not be read to the end


class OpenAIBatches:
    def __init__(self, base_url: str, api_key: str):
        try:
            from openai import OpenAI
        except ImportError:
            raise ValueError(
                "fleetbatch loadgen chaos needs the openai package: pip install openai"
            ) from None
        for name in ("httpx", "httpx2", "openai"):  # the client logs every request at INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        self.client = OpenAI(base_url=base_url, api_key=api_key, max_retries=5, timeout=60)

    def create(self, name: str, items: list[WorkItem]) -> OpenAIRun:
        """Upload ``items`` as an input file and create its batch."""
        rows = input_rows(items, CHAT)
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        f = self.client.files.create(file=(f"{name}.jsonl", data), purpose="batch")
        b = self.client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        log.warning("chaos: OpenAI batch %s (%s, %d rows) created", b.id, name, len(rows))
        return OpenAIRun(name, rows, b.id)

    def status(self, run: OpenAIRun) -> str:
        return self.client.batches.retrieve(run.batch_id).status

    def read(self, run: OpenAIRun, timeout_s: float) -> None:
        """Wait (bounded) for the batch to be final, then download its files."""
        deadline = time.monotonic() + timeout_s
        try:
            batch = self.client.batches.retrieve(run.batch_id)
            while batch.status not in FINAL:
                if time.monotonic() > deadline:
                    run.problem = f"still {batch.status} after {timeout_s:.0f} s"
                    run.batch = batch
                    return
                time.sleep(0.5)
                batch = self.client.batches.retrieve(run.batch_id)
            run.batch = batch
            run.output = self._lines(batch.output_file_id)
            run.errors = self._lines(batch.error_file_id)
        except Exception as e:  # an HTTP or client error: reported, counted as missing lines  # noqa: BLE001
            run.problem = f"{type(e).__name__}: {e}"

    def _lines(self, file_id: str | None) -> list[dict]:
        if not file_id:
            return []
        return [json.loads(x) for x in self.client.files.content(file_id).text.splitlines() if x.strip()]


def _message(line: dict) -> str:
    """An error line's message (``error.message``, or the error body of a non-200 response)."""
    err = line.get("error") or ((line.get("response") or {}).get("body") or {}).get("error") or {}
    return str(err.get("message", "")) if isinstance(err, dict) else str(err)


def user_view(runs: list[OpenAIRun]) -> dict:
    """The user-level counts over the OpenAI batches (see the module docstring)."""
    missing = duplicated = wrongly_failed = 0
    problems: list[str] = []
    for run in runs:
        wanted = [r["custom_id"] for r in run.rows]
        seen = [x.get("custom_id") for x in run.output + run.errors]
        missing += len(set(wanted) - set(seen))
        duplicated += len(seen) - len(set(seen))
        wrongly_failed += sum(
            1 for x in run.errors if not legit_failure(str(x.get("custom_id")), _message(x))
        )
        if run.problem:
            problems.append(f"{run.name} ({run.batch_id}): {run.problem}")
        b = run.batch
        if b is None or run.problem:
            continue
        if b.status != "completed":
            problems.append(f"{run.name} ({run.batch_id}): status {b.status}")
        c = b.request_counts
        if c is None or (c.completed, c.failed, c.total) != (len(run.output), len(run.errors), len(wanted)):
            got = (c.completed, c.failed, c.total) if c is not None else None
            problems.append(
                f"{run.name} ({run.batch_id}): request_counts (completed, failed, total) {got}, "
                f"files hold {len(run.output)} output and {len(run.errors)} error lines of {len(wanted)}"
            )
        problems += [f"{run.name} ({run.batch_id}): {p}" for p in batch_problems(b, run.output)]
    return {
        "output_lines_missing": missing,
        "output_lines_duplicated": duplicated,
        "wrongly_failed_lines": wrongly_failed,
        "openai_violations": len(problems),
        "openai_problems": problems[:20],
    }
