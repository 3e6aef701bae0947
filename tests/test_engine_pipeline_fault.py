"""SIGKILL one stage process of a pipelined ``fleetbatch engine serve`` mid-batch: a clear error naming the stage,
the worker's queries go back to the queue, another worker finishes them, each exactly once, no orphan; and a stage
killed while its worker is idle stops that worker too (the second worker, once the batch is done: one engine
start-up fewer than a test of its own)."""

from __future__ import annotations

import os
import re
import signal
from collections import Counter

import pytest

from tests.harness import start_engine, wait_until, write_plan
from workqueue import QueuedQuery, WorkQueue, connect

N = 10
ENGINE_ARGS = ("--backend", "native", "--size", "nano", "--heartbeat-s", "0.3")


def _plan(path) -> str:
    """llama:nano (2 layers) over two devices, the second 4x slower (so queries stay in flight a while)."""
    return str(write_plan(path, "nano", [0, 1, 2], [16, 8], slowdowns=[0.0, 3.0]))


def _start_pipelined(cluster: str, redis_url: str, tmp_path, *extra: str) -> tuple:
    """``fleetbatch engine serve --plan`` for ``cluster``; returns the process and its stage process's pid (from its log)."""
    engine = start_engine(
        cluster, redis_url, tmp_path, *ENGINE_ARGS, *extra, "--plan", _plan(tmp_path / "plan.json")
    )
    log_path = tmp_path / f"engine-{cluster}.log"
    try:
        pids = wait_until(
            lambda: re.search(r"stage pids \[(\d+)\]", log_path.read_text()), 180, "the stage process"
        )
    except BaseException:
        engine.kill()
        engine.wait()
        raise
    return engine, int(pids.group(1))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_killed_stage_requeues_and_every_query_finishes_once(redis_url, tmp_path):
    queue = WorkQueue(connect(redis_url))
    queries = [
        QueuedQuery("b1", f"q{i}", f"tell me about the river number {i}", 200, 8, 60.0, forced_length=60 + i)
        for i in range(N)
    ]
    assert queue.create_batch("b1", [(q, "pp") for q in queries])
    engine, stage_pid = _start_pipelined("pp", redis_url, tmp_path, "--lease-s", "30")
    log_path = tmp_path / "engine-pp.log"
    try:
        wait_until(
            lambda: queue.result_count("b1") >= 1 and queue.inflight_ids("pp"), 180, "queries in flight"
        )
        os.kill(stage_pid, signal.SIGKILL)
        assert engine.wait(timeout=60) == 1  # the worker stops with an error
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    log = log_path.read_text()
    assert re.search(
        rf"stage 1 \(layers \[1, 2\) on CPU@x4\), pid {stage_pid}, died \(killed by signal 9\)", log
    )
    assert re.search(r"gave [1-9]\d* in-flight queries back to the queue of pp", log)
    assert not _alive(stage_pid)
    assert not queue.inflight_ids("pp")  # nothing left waiting for a lease to lapse
    done_before = queue.result_count("b1")
    assert done_before < N
    # another pipelined worker of the same cluster finishes the rest (its own log: the first one's is read above)
    rescue_dir = tmp_path / "rescue"
    rescue_dir.mkdir()
    rescue, rescue_stage = _start_pipelined("pp", redis_url, rescue_dir, "--lease-s", "30")
    try:
        wait_until(lambda: queue.result_count("b1") >= N, 240, "every result")
        results = queue.results("b1")
        counts = Counter(r["query_id"] for r in results)
        assert sorted(counts) == sorted(q.query_id for q in queries) and set(counts.values()) == {1}
        assert all(r["completion_tokens"] == 60 + int(r["query_id"][1:]) for r in results)
        assert any(r["attempts"] > 1 for r in results)
        # the batch is done and nothing is queued: idle, the worker still notices a dead stage, says which, exits 1
        wait_until(lambda: not queue.inflight_ids("pp"), 60, "the second worker idle")
        os.kill(rescue_stage, signal.SIGKILL)
        assert rescue.wait(timeout=60) == 1
    finally:
        if rescue.poll() is None:
            rescue.kill()
            rescue.wait()
    assert re.search(
        rf"stage 1 \(layers \[1, 2\) on CPU@x4\), pid {rescue_stage}, died",
        (rescue_dir / "engine-pp.log").read_text(),
    )
    assert not _alive(rescue_stage)
    assert queue.result_count("b1") == N  # the idle kill gave nothing back and wrote nothing again
