"""Redis restarts (data kept, AOF) while an engine works: the worker rides it out and every query
finishes exactly once, with no process restarted by hand."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tests.harness import start_engine, wait_until
from workqueue import QueuedQuery, WorkQueue, connect
from workqueue.embedded import EmbeddedRedis

N = 12


@pytest.mark.slow
def test_engine_survives_a_redis_restart(tmp_path):
    run_dir = tmp_path / "redis"
    server = EmbeddedRedis(run_dir, persist=True)
    url = server.url
    queue = WorkQueue(connect(url))
    queries = [
        QueuedQuery("b1", f"q{i}", f"a question about rivers {i}", 64, 6, 30.0, forced_length=30)
        for i in range(N)
    ]
    assert queue.create_batch("b1", [(q, "w") for q in queries])
    args = (
        "--backend",
        "native",
        "--size",
        "nano",
        "--max-running",
        "2",
        "--lease-s",
        "20",
        "--heartbeat-s",
        "0.3",
    )
    engine = start_engine("w", url, tmp_path, *args, "--slowdown", "2")
    try:
        wait_until(lambda: queue.result_count("b1") >= 2, 180, "the first results")
        server.close()  # a graceful restart: SHUTDOWN writes the data, the engine sees connection errors
        log_file = tmp_path / "engine-w.log"
        wait_until(
            lambda: engine.poll() is not None or "Redis unavailable" in log_file.read_text(), 30, "the outage"
        )
        assert engine.poll() is None, "the engine exited when Redis went away"
        server = EmbeddedRedis(run_dir, persist=True)
        queue = WorkQueue(connect(url))
        wait_until(lambda: queue.result_count("b1") >= N, 240, "every result after the restart")
        assert engine.poll() is None
        results = queue.results("b1")
        batch = queue.batch("b1")
    finally:
        if engine.poll() is None:
            engine.send_signal(signal.SIGTERM)
            engine.wait(timeout=60)
        server.close()
    log = (tmp_path / "engine-w.log").read_text()
    assert "Redis is back after" in log
    counts = Counter(r["query_id"] for r in results)
    assert sorted(counts) == sorted(q.query_id for q in queries) and set(counts.values()) == {1}
    assert all(r["completion_tokens"] == 30 for r in results)
    assert batch.status == "completed" and batch.completed == N
