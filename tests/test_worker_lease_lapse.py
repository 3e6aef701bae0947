"""Issue 31, finding 1 (the queue agent's ticks since issue 33): a worker whose lease lapsed (a Redis outage longer than the lease) is handed
back a query it still runs. The lapse is injected (the lease's deadline set in the past, as a
lapsed lease leaves it), then "the offloader" requeues it before the worker renews, as happens
when Redis comes back. The worker must keep running the query and write its real result once."""

from __future__ import annotations

import time

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.worker import Worker, WorkerConfig
from localmodels import build_model, default_tokenizer
from workqueue import QueuedQuery, WorkQueue, connect, keys


def lapse(queue: WorkQueue, cluster: str, gid: str) -> None:
    """The lease of ``gid`` runs out (as after an outage longer than the lease)."""
    queue.r.zadd(keys.inflight(cluster), {gid: 0}, xx=True)


def outage(worker: Worker) -> None:
    """The worker could not renew for a whole lease (Redis was down, or the process stopped)."""
    worker.agent.renewed_at -= worker.config.lease_s


def queue_round(worker: Worker) -> None:
    """One tick of the queue agent, run here, and the claimed queries handed to the engine."""
    worker.start_claimed()  # tells the agent how many queries the engine can take
    worker.agent.poll_now()  # as the wake channel does when queries land
    assert worker.agent.tick()
    worker.start_claimed()


def make_worker(queue: WorkQueue, lease_s: float = 15.0, heartbeat_s: float = 1.0, **engine_kw) -> Worker:
    tok = default_tokenizer()
    engine = LLMEngine(
        build_model("llama", "nano", tokenizer=tok, seed=3),
        tok,
        EngineConfig(kv_budget_tokens=512, block_size=4, **engine_kw),
    )
    config = WorkerConfig(
        cluster="w", backend="native", record_observed=False, lease_s=lease_s, heartbeat_s=heartbeat_s
    )
    return Worker(queue, engine, config)


class TickSpy:
    """Records the claims and renewals of every tick the worker makes (the real ones run)."""

    def __init__(self, queue: WorkQueue) -> None:
        self.claim_call, self.renew_calls = queue.claim_call, queue.renew_calls
        self.events: list[tuple[str, list[str], int]] = []  # (claim | renew, gids renewed, queries held)
        self.held = lambda: 0
        self.due = lambda: True  # whether a renewal was due when the tick was built
        self.renewed_when_due: list[bool] = []  # per event that carried renewals: was a renewal due then?
        queue.claim_call = self.claim  # type: ignore[method-assign]
        queue.renew_calls = self.renew  # type: ignore[method-assign]

    def claim(self, cluster, n, worker_id, lease_s, now, renew=()):
        self.events.append(("claim", list(renew), self.held()))
        if renew:
            self.renewed_when_due.append(self.due())
        return self.claim_call(cluster, n, worker_id, lease_s, now, renew)

    def renew(self, cluster, gids, lease_s, worker_id=""):
        self.events.append(("renew", list(gids), self.held()))
        self.renewed_when_due.append(self.due())
        return self.renew_calls(cluster, gids, lease_s, worker_id)


def test_a_requeued_query_the_worker_still_runs_is_not_failed(redis_url):
    queue = WorkQueue(connect(redis_url))
    q = QueuedQuery("b1", "q0", "a question about rivers", 64, 6, 20.0, forced_length=20)
    assert queue.create_batch("b1", [(q, "w")])
    worker = make_worker(queue)
    queue_round(worker)  # the agent's tick claims the query, the step loop starts it
    assert list(worker.inflight) == [q.gid] and worker.engine.has_unfinished()
    outage(worker)
    lapse(queue, "w", q.gid)
    assert queue.requeue_expired("w") == 1  # the offloader, before the worker's keeper renews
    assert worker.run(max_queries=1) == 1
    (result,) = queue.results("b1")
    assert result["finish_reason"] == "length" and not result.get("error"), result
    assert result["completion_tokens"] == 20 and result["attempts"] == 1
    info = queue.batch("b1")
    assert (info.status, info.completed, info.failed) == ("completed", 1, 0)
    assert queue.queued_ids("w") == [] and queue.inflight_ids("w") == []
    assert abs(float(queue.r.get(keys.pending("w")) or 0)) < 1e-6


def test_a_claim_takes_back_the_workers_own_requeued_queries_first(redis_url):
    """The claim carries the worker's renewals: its own requeued queries come back to it (no new
    attempt, out of the queue and its pending tokens), and the claim pops only other queries."""
    queue = WorkQueue(connect(redis_url))
    qs = [QueuedQuery("b1", f"q{i}", f"prompt {i}", 16, 4, 6.0) for i in range(3)]
    assert queue.create_batch("b1", [(x, "w") for x in qs])
    (mine,) = queue.claim("w", 1, "w1", 30)
    lapse(queue, "w", mine.query.gid)
    assert queue.requeue_expired("w") == 1
    assert queue.queued_ids("w") == ["b1:q0", "b1:q1", "b1:q2"]
    got = queue.claim("w", 1, "w1", 30, renew=[mine.query.gid])
    assert [c.query.gid for c in got] == ["b1:q1"]
    assert sorted(queue.inflight_ids("w")) == ["b1:q0", "b1:q1"]
    assert queue.queued_ids("w") == ["b1:q2"]
    assert abs(float(queue.r.get(keys.pending("w"))) - 10.0) < 1e-6
    assert queue.r.hget(keys.query("b1:q0"), "attempts") == "1"
    # a query requeued and then claimed by another worker is that worker's now: not taken back
    lapse(queue, "w", "b1:q1")
    assert queue.requeue_expired("w") == 1
    (other,) = queue.claim("w", 1, "w2", 30)
    assert other.query.gid == "b1:q1"
    assert queue.claim("w", 0, "w1", 30, renew=["b1:q0", "b1:q1"]) == []
    assert queue.r.hget(keys.query("b1:q1"), "worker") == "w2"
    # the keeper's renewal takes its own requeued queries back too
    lapse(queue, "w", "b1:q0")
    assert queue.requeue_expired("w") == 1
    assert queue.renew("w", ["b1:q0"], 30, worker_id="w1") == 1
    assert queue.queued_ids("w") == ["b1:q2"] and "b1:q0" in queue.inflight_ids("w")


def test_ticks_renew_only_when_renewals_fall_due(redis_url):
    """Review of issue 31: every claim passed every running gid (O(running) Lua per claim). A real
    run with two engine slots: queries finish one by one and each freed slot is claimed while the
    other query runs; with renewals fresh (due every 200 s here: a 600 s lease, heartbeats every
    600 s), no tick renews anything, in a RENEW call or in its claim.

    Whether a renewal was due is read off the agent's own clock as each tick is built, not
    assumed from how long the run takes: with the default 1 s heartbeat, a run that a loaded
    machine slowed past a second renewed, rightly, and failed this test."""
    queue = WorkQueue(connect(redis_url))
    qs = [QueuedQuery("b1", f"q{i}", f"prompt {i}", 64, 6, 8.0, forced_length=4 + 6 * i) for i in range(6)]
    assert queue.create_batch("b1", [(x, "w") for x in qs])
    worker = make_worker(queue, lease_s=600.0, heartbeat_s=600.0, max_running=2, queue_depth=0)
    assert worker.config.renew_every_s == 200.0
    spy = TickSpy(queue)
    spy.held = lambda: len(worker.inflight)
    agent = worker.agent
    spy.due = lambda: time.monotonic() - agent.renewed_at >= worker.config.renew_every_s
    assert worker.run(max_queries=6) == 6
    assert queue.batch("b1").completed == 6
    assert any(kind == "claim" and held for kind, _, held in spy.events), (
        "no claim was made while a query ran"
    )
    assert all(spy.renewed_when_due), "a tick renewed though no renewal was due"


def test_after_an_outage_the_tick_renews_before_it_claims_and_takes_its_query_back(redis_url):
    queue = WorkQueue(connect(redis_url))
    assert queue.create_batch("b1", [(QueuedQuery("b1", "q0", "p", 64, 6, 20.0, forced_length=20), "w")])
    worker = make_worker(queue)
    spy = TickSpy(queue)
    queue_round(worker)  # claims q0
    assert list(worker.inflight) == ["b1:q0"]
    outage(worker)
    lapse(queue, "w", "b1:q0")
    assert queue.requeue_expired("w") == 1
    assert queue.create_batch("b2", [(QueuedQuery("b2", "q1", "p", 64, 6, 20.0, forced_length=20), "w")])
    spy.events.clear()
    queue_round(worker)
    assert [(kind, gids) for kind, gids, _ in spy.events] == [("renew", ["b1:q0"]), ("claim", ["b1:q0"])]
    assert sorted(worker.inflight) == ["b1:q0", "b2:q1"]
    assert queue.queued_ids("w") == [] and queue.r.hget(keys.query("b1:q0"), "attempts") == "1"
    spy.events.clear()
    queue_round(worker)  # the renewal is fresh: the next tick carries none
    assert [kind for kind, _, _ in spy.events if kind == "renew"] == []


def test_a_tick_renews_before_it_claims_when_redis_lacks_the_renew_script(redis_url):
    """A Redis that lost its scripts (a restart, a failover) and got the CLAIM script back from another
    worker first refuses the tick's RENEW (``NOSCRIPT``) but runs its CLAIM; the refused RENEW is sent
    again only after it. The claim must still not pop the worker's own requeued query as a new attempt
    (on its last attempt it would fail a query its worker still runs): the claim takes it back first."""
    queue = WorkQueue(connect(redis_url))
    assert queue.create_batch("b1", [(QueuedQuery("b1", "q0", "p", 64, 6, 20.0, forced_length=20), "w")])
    worker = make_worker(queue)
    queue_round(worker)  # claims q0
    assert list(worker.inflight) == ["b1:q0"]
    outage(worker)
    lapse(queue, "w", "b1:q0")
    assert queue.requeue_expired("w") == 1
    queue.r.script_flush()  # Redis lost its scripts ...
    queue.r.script_load(queue.lease_ops._claim.script)  # ... and another worker's claim loaded CLAIM again
    assert queue.create_batch("b2", [(QueuedQuery("b2", "q1", "p", 64, 6, 20.0, forced_length=20), "w")])
    queue_round(worker)
    assert sorted(worker.inflight) == ["b1:q0", "b2:q1"]
    assert queue.queued_ids("w") == [] and queue.r.hget(keys.query("b1:q0"), "attempts") == "1"
