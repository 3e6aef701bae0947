"""`fleetbatch loadgen soak`: one large batch submitted and streamed back through one gateway, predictor off and on.

For each predictor setting (the prompt-length heuristic, then the learned one) a fresh
``fleetbatch gateway serve`` process (own process, so its memory is its own) on an embedded Redis takes
one ``-n``-query generated batch. The soak measures:

* ``accepted_queries_per_s``: queries / seconds from the submit until every query of the
  batch is on a cluster queue (the intake's end: the answer for a batch created in
  ``SubmitBatch``, the last chunk for one the gateway enqueues in the background), predictor
  off; ``answer_s`` is how long ``SubmitBatch`` itself took;
* ``predictor_intake_ratio``: the same with the learned predictor on, divided by the
  learned predictor's own queries/s on the same prompts and torch threads, timed in this
  process in the same run (what ``fleetbatch predictor bench`` times), right before and right after the
  predictor-on run, averaged (the load of a shared host drifts);
* ``first_enqueue_s``: seconds from the submit to the first query on a cluster queue
  (Redis polled every 5 ms), predictor on;
* ``peak_rss_growth_mb``: the gateway's peak resident memory (``VmHWM``) minus its resident
  memory before the submit, the larger of the two runs;
* ``lost`` and ``duplicated``: results streamed back through the gateway's
  ``StreamResults`` (resumable, :func:`load.client.stream_results`) against the queries sent.

Engines are stood in by drain threads that claim and complete queries directly in Redis,
started once the intake is over (on a small host they would otherwise take the CPU the
intake is measured on): the soak measures the gateway, not the model. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from clusterfile import dump_cluster_file
from gateway.grpc_api.auth import TOKENS_ENV
from gateway.grpc_api.tls import channel
from load.client import stream_results, to_request
from load.workload import generated
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from workqueue import QueryResult, QueryState, WorkQueue, connect, keys
from workqueue.embedded import URL_ENV, EmbeddedRedis

CLUSTERS = ("fast", "medium", "slow")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--num-queries", type=int, default=100_000, help="queries in the soak batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated workload")
    p.add_argument("--predictor", default="shipped", help="the learned predictor: shipped or a model dir")
    p.add_argument("--predictor-threads", type=int, default=1, help="torch threads for prediction")
    p.add_argument("--drainers", type=int, default=3, help="threads standing in for engines")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")


def memory(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` of a process, in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def start_gateway(
    redis_url: str, predictor: str, threads: int, run_dir: Path, token: str
) -> tuple[subprocess.Popen, str]:
    dump_cluster_file(run_dir / "clusters.yaml", [{"name": c, "capacity_tps": 100} for c in CLUSTERS])
    cmd = [
        sys.executable, "-m", "gateway.cli", "serve", "--listen", "127.0.0.1:0",
        "--clusters", str(run_dir / "clusters.yaml"), "--no-offload", "--predictor", predictor,
        "--predictor-threads", str(threads), "--max-request-mb", "1024",
    ]  # fmt: skip
    env = dict(
        os.environ, **{URL_ENV: redis_url, TOKENS_ENV: f"soak:{token}"}
    )  # secrets off the command line
    return launch(cmd, env, r"gateway listening on (\S+)", "listening")


def launch(cmd: list[str], env: dict[str, str], ready: str, what: str) -> tuple[subprocess.Popen, str]:
    """Start ``cmd`` and read its log until a line matches ``ready``; (the process, the match's first group).
    The log is drained from then on; a process that exits first is an error naming ``what`` it did not reach."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        m = re.search(ready, line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, m.group(1)
    raise RuntimeError(f"fleetbatch gateway serve exited with {proc.wait()} before {what}")


def drain(queue: WorkQueue, stop: threading.Event, cluster: str) -> None:
    while not stop.is_set():
        claimed = queue.claim(cluster, 256, f"soak-{cluster}", 120)
        if not claimed:
            time.sleep(0.01)
            continue
        for c in claimed:
            q = c.query
            result = QueryResult(q.batch_id, q.query_id, text="", completion_tokens=1)
            queue.complete(q.gid, result, QueryState.COMPLETED, 1)


def _first_enqueue(queue: WorkQueue, t0: float, done: threading.Event, out: list[float]) -> None:
    names = [keys.queue(c) for c in CLUSTERS]
    while not done.is_set():
        pipe = queue.r.pipeline(transaction=False)
        for n in names:
            pipe.zcard(n)
        if any(pipe.execute()):
            out.append(time.perf_counter() - t0)
            return
        time.sleep(0.005)


def _intake_over(queue: WorkQueue, batch_id: str) -> bool:
    """Every query of the batch is enqueued (or finished): its background intake, if any, is done."""
    done, total = queue.r.hmget(keys.batch(batch_id), "intake_done", "intake_total")
    return total is None or int(done or 0) >= int(total)


def _wait_intake(queue: WorkQueue, batch_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _intake_over(queue, batch_id):
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id}: intake not over after {timeout:g} s")
        time.sleep(0.005)


def _one_run(predictor: str, args, items, run_dir: Path) -> dict:
    with EmbeddedRedis(run_dir / f"redis-{predictor.replace('/', '_')}", persist=False) as server:
        queue = WorkQueue(connect(server.url), retention_s=0)
        token = secrets.token_urlsafe(24)
        proc, address = start_gateway(server.url, predictor, args.predictor_threads, run_dir, token)
        stop, done = threading.Event(), threading.Event()
        try:
            base = memory(proc.pid)["VmRSS"]
            request = to_request(items, batch_id="soak")
            first: list[float] = []
            options = [("grpc.max_send_message_length", 1 << 30)]
            with channel(address, options=options, token=token) as ch:
                stub = pb_grpc.BatchServiceStub(ch)
                t0 = time.perf_counter()
                watcher = threading.Thread(target=_first_enqueue, args=(queue, t0, done, first), daemon=True)
                watcher.start()
                batch = stub.SubmitBatch(request, timeout=args.timeout)
                answer_s = time.perf_counter() - t0
                _wait_intake(queue, batch.id, args.timeout)
                submit_s = time.perf_counter() - t0
                drainers = [
                    threading.Thread(
                        target=drain, args=(queue, stop, CLUSTERS[i % len(CLUSTERS)]), daemon=True
                    )
                    for i in range(max(args.drainers, len(CLUSTERS)))
                ]
                for t in drainers:
                    t.start()
                results: list[dict] = []
                stream_results(stub, batch.id, results, timeout_s=args.timeout)
                stream_s = time.perf_counter() - t0 - submit_s
                final = stub.GetBatch(pb.GetBatchRequest(batch_id=batch.id), timeout=30)
            mem = memory(proc.pid)
        finally:
            stop.set()
            done.set()
            proc.terminate()
            proc.wait(timeout=30)
    ids = [r["query_id"] for r in results]
    sent = {it.id for it in items}
    return {
        "predictor": predictor,
        "queries": len(items),
        "answer_s": round(answer_s, 3),
        "answered_status": pb.BatchStatus.Name(batch.status).lower(),
        "intake_s": round(submit_s, 3),
        "accepted_queries_per_s": round(len(items) / submit_s, 1),
        "first_enqueue_s": round(first[0], 3) if first else round(submit_s, 3),
        "stream_s": round(stream_s, 2),
        "status": pb.BatchStatus.Name(final.status).lower(),
        "peak_rss_growth_mb": round(mem["VmHWM"] - base, 1),
        "lost": len(sent - set(ids)),
        "duplicated": len(ids) - len(set(ids)),
    }


def predictor_qps(predictor: str, prompts: list[str], threads: int) -> float:
    """Queries/s of the learned predictor alone on ``prompts``, on ``threads`` torch threads."""
    import torch

    from predictor.serving import LengthPredictor

    torch.set_num_threads(threads)
    p = LengthPredictor.from_dir(predictor)
    if p.is_fallback:
        raise ValueError(f"predictor {predictor!r} did not load a learned model")
    sample = prompts[: min(len(prompts), 4096)]
    p.predict(sample[:64])  # warm-up
    t0 = time.perf_counter()
    p.predict(sample)
    return len(sample) / (time.perf_counter() - t0)


def run(args) -> dict:
    if args.num_queries < 1:
        raise ValueError("--num-queries must be >= 1")
    items = generated(args.num_queries, args.seed, 64, forced=False)
    with tempfile.TemporaryDirectory(prefix="fleetbatch-soak-") as tmp:
        off = _one_run("heuristic", args, items, Path(tmp))
        print(f"predictor off: {off}", file=sys.stderr, flush=True)
        prompts = [it.prompt for it in items]
        before = predictor_qps(args.predictor, prompts, args.predictor_threads)
        on = _one_run(args.predictor, args, items, Path(tmp))
        print(f"predictor on: {on}", file=sys.stderr, flush=True)
    after = predictor_qps(args.predictor, prompts, args.predictor_threads)
    bench = (before + after) / 2  # the host's load drifts: timed right before and right after the intake
    return {
        "queries": args.num_queries,
        "accepted_queries_per_s": off["accepted_queries_per_s"],
        "accepted_queries_per_s_predictor_on": on["accepted_queries_per_s"],
        "predictor_bench_queries_per_s": round(bench, 1),
        "predictor_bench_before_after": [round(before, 1), round(after, 1)],
        "predictor_intake_ratio": round(on["accepted_queries_per_s"] / bench, 3),
        "first_enqueue_s": on["first_enqueue_s"],
        "first_enqueue_s_predictor_off": off["first_enqueue_s"],
        "peak_rss_growth_mb": max(off["peak_rss_growth_mb"], on["peak_rss_growth_mb"]),
        "lost": off["lost"] + on["lost"],
        "duplicated": off["duplicated"] + on["duplicated"],
        "runs": [off, on],
    }
