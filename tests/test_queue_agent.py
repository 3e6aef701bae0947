"""Issue 33: the queue agent does the worker's Redis work on its own thread, so the engine never
waits on Redis. Real Redis, real engines, a real TCP proxy for the slow or cut link; no timing
assertions (the link's delays only have to be long against a lease's slack to matter)."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engines.config import EngineConfig
from engines.device import StepCost
from engines.engine import LLMEngine
from engines.interface import RequestOutput
from engines.metrics import WorkerCollector
from engines.queue_agent import QueueAgent
from engines.worker import Worker, WorkerConfig
from load.tcp_proxy import Link, TcpProxy
from localmodels import build_model, default_tokenizer
from tests.harness import wait_until
from workqueue import ClaimedQuery, QueuedQuery, WorkQueue, connect, keys


def agent(queue: WorkQueue, rate: float = 0.0, **config) -> QueueAgent:
    return QueueAgent(
        queue,
        WorkerConfig(cluster="w", backend="native", record_observed=False, **config),
        "w1",
        register={"backend": "native"},
        rate_tps=lambda: rate,
        heartbeat_fields=dict,
    )


def batch(
    queue: WorkQueue, batch_id: str, n: int, predicted: float = 10.0, deadline: float = 0.0, **kw
) -> list[str]:
    qs = [
        QueuedQuery(batch_id, f"q{i}", f"a question about rivers {i}", 64, 6, predicted, **kw)
        for i in range(n)
    ]
    assert queue.create_batch(batch_id, [(q, "w") for q in qs], deadline=deadline)
    return [q.gid for q in qs]


def test_claims_ahead_what_the_next_ticks_need_within_bounds(redis_url):
    queue = WorkQueue(connect(redis_url))
    batch(queue, "b1", 200)
    a = agent(queue, rate=100.0, claim_ahead_s=2.0, max_ahead=64, lease_s=15.0)
    a.free_slots = 3
    assert a.claim_count() == 3  # no tick measured, no mean length known: what the engine can take
    assert a.tick() and len(a.inbox) == 3
    a.free_slots = 0
    a.tick_s = 0.1  # a tick takes 100 ms (a slow link): 3 ticks = 0.3 s = 30 tokens = 3 queries of 10
    assert a.claim_count() == 0  # the 3 waiting queries hold the horizon's 30 predicted tokens
    a.tick_s = 0.2
    assert a.claim_count() == 3  # 60 tokens: 3 more
    a.tick_s = 10.0  # bounded by claim_ahead_s (2 s: 200 tokens, 20 queries) ...
    assert a.claim_count() == 20 - 3
    a.config.lease_s = 3.0  # ... by a third of the lease (1 s: 100 tokens) ...
    assert a.claim_count() == 10 - 3
    a.config.lease_s, a.config.max_ahead = 15.0, 5  # ... and by max_ahead queries held ahead in all
    assert a.claim_count() == 5 - 3
    assert a.tick() and len(a.inbox) == 5 and a.claim_count() == 0
    a.free_slots = 2  # room in the engine comes on top
    assert a.claim_count() == 2 + 0 and len(queue.queued_ids("w")) == 195  # the rest stays movable
    assert [cq.query.gid for cq in a.take(2)] == ["b1:q0", "b1:q1"] and len(a.inbox) == 3
    assert a.free_slots == 0  # taken: until the step loop says again


def test_results_are_written_once_and_a_repeated_tick_changes_nothing(redis_url):
    queue = WorkQueue(connect(redis_url))
    gids = batch(queue, "b1", 2)
    a = agent(queue)
    a.free_slots = 2
    assert a.tick() and [cq.query.gid for cq in a.take(2)] == gids
    a.done([RequestOutput(g, "text", [1, 2], 5, "stop", finish_time=1.0) for g in gids])
    req = a.request()
    assert [f.gid for f in req.results] == gids
    assert a.tick(req)
    assert a.finished == 2 and a.unwritten() == 0 and not a.inflight
    # the same tick again, as after a reply lost to a cut link (the agent still held them): no change
    a.done([RequestOutput(g, "other", [3], 5, "stop") for g in gids])  # not held any more: ignored
    assert a.unwritten() == 0
    assert a.tick(req)
    results = queue.results("b1")
    assert sorted(r["query_id"] for r in results) == ["q0", "q1"] and {r["text"] for r in results} == {"text"}
    assert queue.batch("b1").completed == 2


@pytest.mark.parametrize("stop", ["cancel", "expire"])
def test_a_cancel_or_an_expiry_is_seen_within_one_tick(redis_url, stop):
    queue = WorkQueue(connect(redis_url))
    deadline = queue.clock() + 3600
    batch(queue, "b1", 4, deadline=deadline)
    batch(queue, "b2", 1)
    a = agent(queue)
    a.free_slots = 5
    assert a.tick() and len(a.inbox) == 5
    running = [cq.query.gid for cq in a.take(1)]  # b1:q0 runs; b1:q1..q3 and b2:q0 wait
    if stop == "cancel":
        queue.cancel_batch("b1")
    else:
        assert queue.expire_due(deadline + 1) == ["b1"]
    a.config.cancel_check_s = 0.0  # a tick is due at once (the agent ticks at least this often)
    assert a.tick(a.request())  # the next tick reads the statuses
    assert a.aborts() == running and a.aborts() == []  # the step loop aborts the running one, once
    assert [cq.query.gid for cq in a.inbox] == ["b2:q0"]  # the waiting ones are answered at once
    assert a.unwritten() == 3
    a.done([RequestOutput(running[0], "", [], 0, "abort", finish_time=2.0)])  # the engine's abort output
    assert a.tick()
    info = queue.batch("b1")
    final, reason = ("cancelled", "cancelled") if stop == "cancel" else ("expired", "batch_expired")
    assert (info.status, info.cancelled, info.completed) == (final, 4, 0)
    assert {r["finish_reason"] for r in queue.results("b1")} == {reason}


def make_worker(url: str, **config) -> Worker:
    tok = default_tokenizer()
    engine = LLMEngine(
        build_model("llama", "nano", tokenizer=tok, seed=3),
        tok,
        EngineConfig(kv_budget_tokens=512, block_size=4),
    )
    cost = StepCost.parse("40,0.1,1")  # a step lasts 40+ ms on the emulated device
    config = WorkerConfig(cluster="w", backend="native", record_observed=False, device_cost=cost, **config)
    return Worker(WorkQueue(connect(url)), engine, config)


def test_the_lease_is_kept_across_a_slow_link_and_the_engine_never_waits(redis_url):
    """Renewals cross a 1 s round trip (0.5 s each way) with a 4 s lease; a query that runs for
    longer than the lease is never requeued, and the engine steps on while ticks are in flight."""
    queue = WorkQueue(connect(redis_url))
    (gid,) = batch(queue, "b1", 1, forced_length=160)  # 160 steps of 40+ ms: longer than the lease
    with TcpProxy(redis_url.removeprefix("unix://")).start() as proxy:
        worker = make_worker(f"redis://{proxy.address}/0", lease_s=4.0)
        proxy.set_links(up=Link(delay_s=0.5), down=Link(delay_s=0.5))
        serving = threading.Thread(target=worker.run, kwargs={"max_queries": 1}, daemon=True)
        serving.start()
        seen: list[str] = []
        try:
            while serving.is_alive():
                seen.append("queued" if gid in queue.queued_ids("w") else "held")
                serving.join(timeout=0.1)
        finally:
            worker.stop()
            serving.join(timeout=30)
    claimed = seen.index("held")
    assert "queued" not in seen[claimed:] and len(seen) - claimed > 10  # never requeued once claimed
    (result,) = queue.results("b1")
    assert result["completion_tokens"] == 160 and result["attempts"] == 1
    assert worker.steps >= 160 and worker.agent.ticks < worker.steps  # steps went on between ticks


def test_the_engine_steps_on_while_its_link_to_redis_is_cut(redis_url):
    queue = WorkQueue(connect(redis_url))
    batch(queue, "b1", 3, forced_length=120)
    with TcpProxy(redis_url.removeprefix("unix://")).start() as proxy:
        worker = make_worker(f"redis://{proxy.address}/0", lease_s=60.0)
        serving = threading.Thread(target=worker.run, kwargs={"max_queries": 3}, daemon=True)
        serving.start()
        try:
            wait_until(lambda: worker.engine.has_unfinished() and worker.steps > 0, 60, "the first steps")
            proxy.cut()  # blackhole: every tick now hangs
            steps = worker.steps
            wait_until(lambda: worker.agent.unwritten() == 3, 120, "every query finished offline")
            assert worker.steps >= steps + 100  # the three ran together for 120 steps, most of them cut off
            assert queue.result_count("b1") == 0
            proxy.heal()
            serving.join(timeout=120)
        finally:
            worker.stop()
            serving.join(timeout=30)
    assert queue.result_count("b1") == 3 and queue.batch("b1").completed == 3
    assert queue.inflight_ids("w") == [] and queue.r.exists(keys.heartbeat("w"))
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    metrics = dict(
        line.rsplit(" ", 1) for line in generate_latest(registry).decode().splitlines() if line[0] != "#"
    )
    assert float(metrics["fleetbatch_worker_steps_total"]) == worker.steps >= 120
    assert float(metrics["fleetbatch_worker_results_written_total"]) == 3
    assert float(metrics["fleetbatch_worker_redis_round_trips_total"]) == worker.round_trips.value > 0
    assert float(metrics["fleetbatch_worker_unwritten_results"]) == 0


def test_queries_claimed_ahead_go_back_on_stop_without_using_an_attempt(redis_url):
    """Review of issue 33: a stopped worker gives back what it claimed ahead and never started; that
    claim's attempt is taken back, so restarts cannot fail a query that never ran."""
    queue = WorkQueue(connect(redis_url))
    gids = batch(queue, "b1", 3)
    a = agent(queue)
    a.free_slots = 3
    assert a.tick() and len(a.inbox) == 3
    assert [cq.query.gid for cq in a.take(1)] == gids[:1]  # b1:q0 runs; the others wait
    assert a.close() == 2
    assert queue.queued_ids("w") == gids[1:] and queue.inflight_ids("w") == gids[:1]
    assert [queue.r.hget(keys.query(g), "attempts") for g in gids] == ["1", "0", "0"]


def test_an_answer_cut_at_max_tokens_is_compared_with_the_estimate_capped_alike(redis_url):
    """Review of [5/7]: the worker compared the raw estimate, uncapped, with an answer cut at max_tokens, so a batch
    with a short cap taught the calibration that the model answers far shorter than it does (old: raw 500.0)."""
    queue = WorkQueue(connect(redis_url))
    a = agent(queue, length_model="m")
    q = QueuedQuery("b", "q0", "a question", 32, 3, 30.0, raw_predicted_tokens=500.0)
    out = RequestOutput("b:q0", "x" * 32, list(range(32)), 3, "length")
    a._observe(ClaimedQuery(q, 1, 0.0, 0.0), out, 0)
    rows, _ = a._observed.for_tick()
    assert [(r.predicted, r.length, r.retrain) for r in rows] == [(32.0, 32, False)]
