"""`fleetbatch loadgen file-soak`: one OpenAI batch file of a million rows sent whole by ``fleetbatch loadgen submit --jsonl``.

Writes an ``-n``-row OpenAI batch input file (chat rows of the generated mix, default 1,000,000), starts
``fleetbatch gateway serve`` (own process, prompt-length heuristic: the predictor is not under test) on an embedded
Redis, and runs ``fleetbatch loadgen submit --jsonl FILE --out OUT`` as a child process, exactly as a user would. Drain
threads stand in for engines: they claim and complete queries directly in Redis (the client and the path are
measured, not the model). It measures:

* ``client_peak_rss_mb``: the submitting client's peak resident memory (its ``VmHWM`` since its ``exec``,
  read every 0.1 s while it runs; a fork's ``ru_maxrss`` would count this process's pages too): the file
  is read row by row and sent in parts, results are written as they come, none kept;
* ``results``, ``lost``, ``duplicated``: the ``--out`` file read back line by line against the rows sent
  (every row's result once), and the client's own exit status (0 only when it saw every row once);
* ``gateway_peak_rss_growth_mb``: the gateway's peak resident memory minus its memory before the submit;
* ``submit_s`` / ``wall_s``: until the batch was accepted (the client's "batch ... (N queries)" line) / until
  the client exited; ``file_mb``: the input file's size.

The last line printed is one JSON object.
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

from load.soaks.soak import CLUSTERS, drain, memory, start_gateway
from load.workload import generated
from workqueue import WorkQueue, connect
from workqueue.embedded import EmbeddedRedis


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--num-queries", type=int, default=1_000_000, help="rows of the batch file")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated rows")
    p.add_argument("--drainers", type=int, default=3, help="threads standing in for engines")
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed for the client")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the file, results and logs here")


def write_file(path: Path, n: int, seed: int, step: int = 10_000) -> None:
    """``n`` chat rows of the generated mix as an OpenAI batch input file (custom ids ``r<i>``), made ``step``
    rows at a time (this process stays small: the client it starts is measured)."""
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, n, step):
            for i, it in enumerate(generated(min(step, n - start), seed + start, 64, forced=False), start):
                body = {"model": "m", "messages": [{"role": "user", "content": it.prompt}], "max_tokens": 8}
                row = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                f.write(json.dumps(row) + "\n")


def check_results(path: Path, n: int) -> dict:
    """The ``--out`` file read line by line: results, and the rows lost or duplicated against ``r0..r<n-1>``."""
    seen = bytearray(n)
    rows = duplicated = strangers = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            qid = json.loads(line)["query_id"]
            rows += 1
            i = int(qid[1:]) if qid.startswith("r") and qid[1:].isdigit() else -1
            if not 0 <= i < n:
                strangers += 1
            elif seen[i]:
                duplicated += 1
            else:
                seen[i] = 1
    return {"results": rows, "lost": n - sum(seen), "duplicated": duplicated, "unknown_ids": strangers}


def run(args) -> dict:
    if args.num_queries < 1:
        raise ValueError("--num-queries must be >= 1")
    with tempfile.TemporaryDirectory(prefix="fleetbatch-file-soak-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        src, out = work / "batch_input.jsonl", work / "results.jsonl"
        t0 = time.perf_counter()
        write_file(src, args.num_queries, args.seed)
        print(f"wrote {args.num_queries} rows ({src.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
        with EmbeddedRedis(work / "redis", persist=False) as server:
            queue = WorkQueue(connect(server.url), retention_s=0)
            token = secrets.token_urlsafe(24)
            gateway, address = start_gateway(server.url, "heuristic", 1, work, token)
            stop = threading.Event()
            drainers = [
                threading.Thread(target=drain, args=(queue, stop, CLUSTERS[i % len(CLUSTERS)]), daemon=True)
                for i in range(max(args.drainers, len(CLUSTERS)))
            ]
            try:
                base = memory(gateway.pid)["VmRSS"]
                for t in drainers:
                    t.start()
                client, submit_s, wall_s, peak_mb = _client(address, token, src, out, work, args.timeout)
                gateway_mem = memory(gateway.pid)
            finally:
                stop.set()
                gateway.terminate()
                gateway.wait(timeout=30)
        checked = check_results(out, args.num_queries)
        return {
            "rows": args.num_queries,
            "file_mb": round(src.stat().st_size / 1e6, 1),
            "client_exit": client,
            "client_peak_rss_mb": round(peak_mb, 1),
            **checked,
            "gateway_peak_rss_growth_mb": round(gateway_mem["VmHWM"] - base, 1),
            "submit_s": submit_s,
            "wall_s": wall_s,
            "ok": client == 0 and checked["lost"] == checked["duplicated"] == checked["unknown_ids"] == 0,
        }


def _client(address: str, token: str, src: Path, out: Path, work: Path, timeout: float):
    """Run ``fleetbatch loadgen submit --jsonl``: (exit status, seconds to acceptance, seconds in all, peak RSS in MB)."""
    cmd = [sys.executable, "-m", "load.cli", "submit", "--target", address, "--jsonl", str(src),
           "--chat-template", "default", "--out", str(out), "--no-progress"]  # fmt: skip
    env = {**os.environ, "FLEETBATCH_TOKEN": token}
    t0 = time.perf_counter()
    with open(work / "client.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE, text=True, env=env)
        accepted: list[float] = []

        def watch() -> None:
            for line in proc.stderr:
                log.write(line)
                if not accepted and line.startswith("batch "):
                    accepted.append(time.perf_counter() - t0)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        deadline, peak_mb = time.monotonic() + timeout, 0.0
        while proc.poll() is None:
            try:  # the high-water mark of the client's own memory since its exec, read while it runs
                peak_mb = max(peak_mb, memory(proc.pid)["VmHWM"])
            except (OSError, KeyError):  # it has just exited
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"fleetbatch loadgen submit did not finish within {timeout:g} s")
            time.sleep(0.1)
        watcher.join(timeout=10)
    wall = time.perf_counter() - t0
    return proc.returncode, round(accepted[0], 1) if accepted else None, round(wall, 1), peak_mb
