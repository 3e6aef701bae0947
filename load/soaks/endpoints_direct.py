"""Run (a) of ``fleetbatch loadgen endpoints``: a plain asyncio OpenAI client (httpx) sends the batch straight
to one server at a fixed concurrency, streaming each chat completion with the server's usage.

:func:`direct_run` sends every row's body (as the endpoint backend would send it: ``stream``,
``stream_options.include_usage``) with at most ``concurrency`` requests in flight and returns the
completion tokens the server counted, the seconds from the first request to the last answer, and each
row's ``usage.prompt_tokens``. A request that fails is sent again (the server is not expected to fail
in this run; one that fails three times fails the run). :func:`warm_up` sends a few untimed requests
first: a server's first batches take far longer than the rest (its kernels and caches warm up).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

log = logging.getLogger(__name__)

TRIES = 3


@dataclass
class DirectResult:
    concurrency: int
    completion_tokens: int = 0
    wall_s: float = 0.0
    prompt_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


def stream_body(body: dict) -> dict:
    """``body`` streamed, with the usage at the end (what the endpoint backend sends)."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed chat completion; returns its usage."""
    usage: dict | None = None
    async with client.stream("POST", url + "/chat/completions", json=stream_body(body)) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                usage = event["usage"]
    if usage is None:
        raise RuntimeError("the stream ended without usage")
    return usage


async def _send_all(url: str, rows: list[dict], concurrency: int, progress: bool, label: str) -> DirectResult:
    result = DirectResult(concurrency)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    bar = tqdm(total=len(rows), desc=label, unit="row", disable=not progress, leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def send(row: dict) -> None:
            async with gate:
                for attempt in range(1, TRIES + 1):
                    try:
                        usage = await _one(client, url, row["body"])
                        break
                    except (httpx.HTTPError, RuntimeError) as e:
                        if attempt == TRIES:
                            raise RuntimeError(f"row {row['custom_id']}: {e}") from e
                        log.warning("row %s: %s; sending it again", row["custom_id"], e)
                result.completion_tokens += int(usage.get("completion_tokens") or 0)
                result.prompt_tokens[row["custom_id"]] = int(usage.get("prompt_tokens") or 0)
                bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(send(r) for r in rows))
        result.wall_s = time.perf_counter() - t0
    bar.close()
    return result


def direct_run(url: str, rows: list[dict], concurrency: int, progress: bool = True) -> DirectResult:
    """Every row of ``rows`` (OpenAI batch input lines) sent straight to ``url`` (an OpenAI base URL)."""
    return asyncio.run(_send_all(url, rows, concurrency, progress, f"direct c={concurrency}"))


def warm_up(url: str, rows: list[dict], concurrency: int, n: int) -> float:
    """``n`` untimed rows (their ``max_tokens`` at most 16) at ``concurrency``; returns the seconds taken."""
    short = [{**r, "body": {**r["body"], "max_tokens": min(16, r["body"]["max_tokens"])}} for r in rows[:n]]
    return direct_run(url, short, concurrency, progress=False).wall_s
