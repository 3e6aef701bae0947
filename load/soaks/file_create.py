"""`fleetbatch loadgen file-create`: a batch created over HTTP from a large input file, and what it costs the gateway's memory.

Writes an OpenAI batch input file of about ``--file-mb`` MB (chat rows of the generated mix, each prompt
padded to about ``--row-bytes``), starts ``fleetbatch gateway serve`` (own process, embedded Redis, the
prompt-length heuristic, three clusters that no engine serves: nothing runs, the creation is measured)
with its HTTP front keeping its files in ``--files`` (a directory of the work dir by default, or
``s3://bucket/prefix`` with the ``AWS_*`` environment), uploads the file with the ``openai`` client, then
creates a batch from it and waits until its intake is over (every row staged, then enqueued). It reads the
gateway's memory from ``/proc/<pid>/status``: the peak (``VmHWM``) is reset after the upload (``clear_refs``)
so that it is the creation's own, and ``psutil`` samples the resident size every 50 ms as a check.

The last line printed is one JSON object: ``rows``, ``file_mb``, ``store``, ``rss_before_create_mb``,
``rss_peak_create_mb``, ``create_growth_mb`` (the peak minus the memory before; the goal is at most 300 MB
for a 200 MB file), ``growth_at_answer_mb`` (the same peak when the creation answered, before the intake
had enqueued every row), ``upload_growth_mb``, ``create_s`` (until the answer), ``intake_s`` (until every row
was enqueued), ``status``, ``ok``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from clusterfile import dump_cluster_file
from gateway.config import HTTP_KEY_ENV
from load.soaks.soak import launch, memory
from load.workload import generated
from workqueue import WorkQueue, connect, keys
from workqueue.embedded import URL_ENV, EmbeddedRedis

CLUSTERS = ("fast", "medium", "slow")
GOAL_MB = 300.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file-mb", type=float, default=200.0, help="size of the generated input file, in MB")
    p.add_argument(
        "--row-bytes", type=int, default=1000, help="about how many bytes each row of the file has"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated rows")
    p.add_argument(
        "--files", default=None, help="the gateway's file store (default: a directory of the work dir)"
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed for the creation and intake")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the file, results and logs here")


def write_file(path: Path, mb: float, row_bytes: int, seed: int, step: int = 10_000) -> int:
    """Chat rows (custom ids ``r<i>``) up to ``mb`` MB, each prompt padded to about ``row_bytes``; the rows."""
    n, size, limit = 0, 0, int(mb * 1e6)
    with open(path, "w", encoding="utf-8") as f:
        while size < limit:
            for it in generated(step, seed + n, 64, forced=False):
                prompt = it.prompt
                while len(prompt) < row_bytes - 150:
                    prompt += " " + it.prompt
                body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
                line = json.dumps(
                    {"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                )
                f.write(line + "\n")
                n, size = n + 1, size + len(line) + 1
                if size >= limit:
                    break
    return n


def reset_peak(pid: int) -> bool:
    """Reset the process's ``VmHWM`` to its resident size now (Linux ``clear_refs``); False when refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    """The process's resident size every ``every_s`` seconds (psutil); ``peak_mb`` the largest seen."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        import psutil

        self.proc, self.every_s, self.peak_mb = psutil.Process(pid), every_s, 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak_mb = max(self.peak_mb, self.proc.memory_info().rss / 2**20)
            except Exception:  # the process has exited
                return
            time.sleep(self.every_s)


def start_gateway(redis_url: str, work: Path, files: str, key: str) -> tuple[subprocess.Popen, str]:
    """``fleetbatch gateway serve`` with its HTTP front; (the process, the HTTP front's base URL)."""
    dump_cluster_file(work / "clusters.yaml", [{"name": c, "capacity_tps": 100} for c in CLUSTERS])
    cmd = [
        sys.executable, "-m", "gateway.cli", "serve", "--listen", "127.0.0.1:0", "--no-auth",
        "--clusters", str(work / "clusters.yaml"), "--no-offload", "--predictor", "heuristic",
        "--http-port", "0", "--files", files, "--chat-template", "default",
    ]  # fmt: skip
    env = dict(os.environ, **{URL_ENV: redis_url, HTTP_KEY_ENV: key})  # secrets off the command line
    return launch(cmd, env, r"OpenAI-compatible HTTP front on (\S+)", "its HTTP front listened")


def run(args) -> dict:
    from openai import OpenAI

    with tempfile.TemporaryDirectory(prefix="fleetbatch-file-create-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        src = work / "batch_input.jsonl"
        rows = write_file(src, args.file_mb, args.row_bytes, args.seed)
        print(f"wrote {rows} rows ({src.stat().st_size / 1e6:.0f} MB)", file=sys.stderr, flush=True)
        files = args.files or str(work / "files")
        with EmbeddedRedis(work / "redis", persist=False) as server:
            queue = WorkQueue(connect(server.url), retention_s=0)
            key = secrets.token_urlsafe(18)
            gateway, url = start_gateway(server.url, work, files, key)
            try:
                client = OpenAI(base_url=url, api_key=key, max_retries=0, timeout=args.timeout)
                base = memory(gateway.pid)["VmRSS"]
                with open(src, "rb") as f:
                    uploaded = client.files.create(file=("input.jsonl", f), purpose="batch")
                after_upload = memory(gateway.pid)
                peak_reset = reset_peak(gateway.pid)
                sampler = Sampler(gateway.pid)
                sampler.start()
                t0 = time.perf_counter()
                batch = client.batches.create(
                    input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
                create_s = time.perf_counter() - t0
                at_answer = memory(gateway.pid)
                _wait_intake(queue, batch.id, args.timeout)
                intake_s = time.perf_counter() - t0
                sampler.stop.set()
                sampler.join()
                mem = memory(gateway.pid)
                batch = client.batches.retrieve(batch.id)
            finally:
                gateway.terminate()
                gateway.wait(timeout=60)
    peak = max(mem["VmHWM"] if peak_reset else 0.0, sampler.peak_mb)
    growth = peak - after_upload["VmRSS"]
    return {
        "command": "file-create",
        "rows": rows,
        "file_mb": round(src.stat().st_size / 1e6, 1) if src.exists() else round(args.file_mb, 1),
        "store": "s3" if files.startswith("s3://") else "directory",
        "rss_before_create_mb": round(after_upload["VmRSS"], 1),
        "rss_peak_create_mb": round(peak, 1),
        "create_growth_mb": round(growth, 1),
        "growth_at_answer_mb": round(at_answer["VmHWM"] - after_upload["VmRSS"], 1) if peak_reset else None,
        "upload_growth_mb": round(after_upload["VmHWM"] - base, 1),
        "peak_from": "VmHWM" if peak_reset else "psutil samples",
        "create_s": round(create_s, 2),
        "intake_s": round(intake_s, 2),
        "status": batch.status,
        "queued": batch.request_counts.total if batch.request_counts else None,
        "ok": growth <= GOAL_MB and batch.status in ("validating", "in_progress"),
    }


def _wait_intake(queue: WorkQueue, batch_id: str, timeout: float) -> None:
    """Until every row of the batch is enqueued (its background intake over)."""
    deadline = time.monotonic() + timeout
    while True:
        done, total = queue.r.hmget(keys.batch(batch_id), "intake_done", "intake_total")
        if total is not None and int(done or 0) >= int(total) or (total is None and queue.batch(batch_id)):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id}: intake not over after {timeout:g} s")
        time.sleep(0.05)
