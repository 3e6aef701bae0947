"""Issue 49, items 3 and 4: preemption with notice, checkpoints, and resumption from a partial output.

Real parts throughout: a real Redis (the session's embedded server), the native engine on the small random
model, in-process workers driven by their own step loops and queue agents, and for the hard kill a real
``fleetbatch engine serve`` process killed by pid with SIGKILL."""

from __future__ import annotations

import signal
import threading

import pytest

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.worker import Worker, WorkerConfig
from gateway.offload.offloader import Offloader
from localmodels import load_or_build
from tests.harness import kill_when, start_engine, wait_until
from workqueue import QueryResult, QueuedQuery, WorkQueue, connect, keys
from workqueue.clusters import parse_state
from workqueue.invariants import check
from workqueue.partial import Partial

PROMPTS = [f"question {i}: how do rivers carve valleys over {i + 3} million years?" for i in range(10)]


def engine(**kw) -> LLMEngine:
    """The native engine on the random nano model ``fleetbatch engine serve --arch llama --size nano`` builds."""
    model, tok = load_or_build(None, arch="llama", size="nano")
    return LLMEngine(model, tok, EngineConfig(kv_budget_tokens=4096, block_size=4, **kw))


@pytest.fixture(scope="module")
def reference() -> dict[tuple[str, int, bool], tuple[list[int], str, int, str]]:
    """Uninterrupted greedy runs, by (prompt, max tokens, forced): token ids, text, prompt tokens, finish reason."""
    cache: dict = {}
    e = engine()

    def run(prompt: str, max_tokens: int, forced: bool = False):
        key = (prompt, max_tokens, forced)
        if key not in cache:
            sp = SamplingParams(max_tokens=max_tokens, forced_length=max_tokens if forced else None)
            out = e.generate([Request(f"r{len(cache)}", prompt, sp)])[0]
            cache[key] = (out.token_ids, out.text, out.prompt_tokens, out.finish_reason)
        return cache[key]

    return run


def query(i: int, max_tokens: int, forced: bool = False, batch: str = "b1") -> QueuedQuery:
    return QueuedQuery(
        batch,
        f"q{i}",
        PROMPTS[i],
        max_tokens,
        12,
        float(max_tokens),
        forced_length=max_tokens if forced else None,
    )


def make_worker(queue: WorkQueue, cluster: str, **config) -> Worker:
    c = WorkerConfig(cluster=cluster, backend="native", record_observed=False, cancel_check_s=0.0, **config)
    return Worker(queue, engine(), c)


def claim_and_start(worker: Worker) -> None:
    """One tick of the worker's queue agent, run here, and the claimed queries handed to the engine."""
    worker.start_claimed()
    worker.agent.poll_now()
    assert worker.agent.tick()
    worker.start_claimed()


def partial(queue: WorkQueue, gid: str) -> Partial | None:
    return Partial.decode(queue.r.hget(keys.query(gid), keys.PARTIAL))


def results(queue: WorkQueue, batch: str) -> list[QueryResult]:
    return [QueryResult.from_json(r) for r in queue.r.lrange(keys.results(batch), 0, -1)]


def preempted_mid_run(queue: WorkQueue, qs: list[QueuedQuery], steps: int = 12) -> tuple[Worker, dict]:
    """A worker of cluster a runs ``qs`` ``steps`` steps, then a notice of 0 s preempts it: its step loop
    checkpoints and gives back every running query and stops. Returns it, and the tokens each had generated."""
    assert queue.create_batch(qs[0].batch_id, [(q, "a") for q in qs])
    worker = make_worker(queue, "a")
    claim_and_start(worker)
    for _ in range(steps):
        worker.step()
    generated = {g: list(worker.engine.partial(g).token_ids) for g in worker.engine.progress()}
    assert sorted(generated) == sorted(q.gid for q in qs) and all(
        len(t) >= steps - 1 for t in generated.values()
    )
    assert queue.give_notice("a", 0) <= 0
    assert worker.agent.tick() and worker.checkpoints.noticed  # the agent's next tick reads the notice
    assert worker.run() == 0  # the step loop gives everything back and stops
    return worker, generated


def test_a_notice_checkpoints_and_releases_without_using_an_attempt(redis_url):
    queue = WorkQueue(connect(redis_url))
    qs = [query(i, 48) for i in range(3)]
    queue.register_cluster("b", capacity_hint_tps=100.0)
    worker, generated = preempted_mid_run(queue, qs)
    assert queue.cluster_state("a") == "draining" and worker.checkpoints.noticed
    for q in qs:
        h = queue.r.hgetall(keys.query(q.gid))
        assert h["state"] == "queued" and int(h.get("attempts", 0)) == 0  # as before its claim: none used
        assert queue.r.zscore(keys.queue("a"), q.gid) is not None
        assert list(partial(queue, q.gid).token_ids) == generated[q.gid]
    assert queue.claim("a", 5, "another-worker", 10.0) == []  # a preempted cluster claims nothing
    assert queue.r.zcard(keys.inflight("a")) == 0 and not worker.inflight
    Offloader(queue).tick()  # the offloader moves the preempted cluster's queue to the others
    assert queue.r.zcard(keys.queue("a")) == 0 and queue.r.zcard(keys.queue("b")) == len(qs)
    claimed = {cq.query.gid: cq for cq in queue.claim("b", 5, "w-b", 10.0)}
    assert {g: list(cq.partial.token_ids) for g, cq in claimed.items()} == generated
    assert all(cq.attempts == 1 for cq in claimed.values())
    assert check(queue.r) == []


def test_a_long_notice_lets_the_running_queries_finish(redis_url, reference):
    queue = WorkQueue(connect(redis_url))
    qs = [query(i, 24, forced=True) for i in range(2)]
    assert queue.create_batch("b1", [(q, "a") for q in qs])
    worker = make_worker(queue, "a")
    claim_and_start(worker)
    worker.notice(3600.0)  # SIGTERM under --grace-s 3600
    assert worker.run() == 2  # both finish within the notice, then the worker stops
    rows = {r.query_id: r for r in results(queue, "b1")}
    assert sorted(rows) == ["q0", "q1"] and all(r.completion_tokens == 24 for r in rows.values())
    assert rows["q0"].text == reference(PROMPTS[0], 24, True)[1]


def test_a_resumed_query_equals_the_uninterrupted_run(redis_url, reference):
    ids, text, prompt_tokens, reason = reference(PROMPTS[5], 40)
    # the engine alone: resumed from any prefix, it ends as the uninterrupted run did, token for token
    e = engine()
    for cut in (1, 17, len(ids) - 1):
        out = e.generate(
            [Request(f"x{cut}", PROMPTS[5], SamplingParams(max_tokens=40), resume=Partial(tuple(ids[:cut])))]
        )
        assert (out[0].token_ids, out[0].prompt_tokens, out[0].finish_reason) == (ids, prompt_tokens, reason)
    # through the queue: preempted on a, moved, resumed on b; its result is the whole answer, counted once
    queue = WorkQueue(connect(redis_url))
    queue.register_cluster("b", capacity_hint_tps=100.0)
    _, generated = preempted_mid_run(queue, [query(5, 40)], steps=15)
    assert 0 < len(generated["b1:q5"]) < len(ids)
    Offloader(queue).tick()
    b = make_worker(queue, "b")
    assert b.run(max_queries=1) == 1
    assert (b.resumed_queries, b.resumed_tokens) == (1, len(generated["b1:q5"]))
    [row] = results(queue, "b1")
    assert (row.text, row.completion_tokens, row.prompt_tokens, row.finish_reason) == (
        text,
        len(ids),
        prompt_tokens,
        reason,
    )
    assert row.attempts == 1  # the preempted run used none
    assert not queue.r.exists(keys.query("b1:q5"))  # the partial output went with the query's hash


def test_checkpoints_never_fall_more_than_n_tokens_behind(redis_url, reference):
    """The step loop does not step a query a checkpoint ahead of Redis: checked after every step."""
    n = 8
    queue = WorkQueue(connect(redis_url))
    qs = [query(i, 60, forced=True) for i in range(3)]
    assert queue.create_batch("b1", [(q, "a") for q in qs])
    worker = make_worker(queue, "a", checkpoint_tokens=n, lease_s=60.0)
    gaps: list[int] = []
    step = worker.engine.step

    def checked_step():
        out = step()
        for g, n_generated in worker.engine.progress().items():
            gaps.append(n_generated - len(partial(queue, g) or ()))
        return out

    worker.engine.step = checked_step
    assert worker.run(max_queries=3) == 3
    assert len(gaps) > 60 and max(gaps) <= n and max(gaps) >= n // 2
    rows = {r.query_id: r for r in results(queue, "b1")}
    assert all(rows[q.query_id].text == reference(q.prompt, 60, True)[1] for q in qs)


def test_a_hard_kill_loses_at_most_n_tokens_and_the_query_resumes(redis_url, reference, tmp_path):
    """A real engine process, SIGKILLed by pid mid-decode: each query's partial output in Redis is a checkpoint
    (at most N tokens behind: the previous test checks the bound step by step), and resumed elsewhere each
    query's answer is the uninterrupted one."""
    n, length = 8, 400
    queue = WorkQueue(connect(redis_url))
    qs = [query(i, length, forced=True) for i in range(2)]
    assert queue.create_batch("b1", [(q, "k") for q in qs])
    proc = start_engine(
        "k", redis_url, tmp_path, "--arch", "llama", "--size", "nano", "--checkpoint-tokens", str(n)
    )
    kill_when(proc, lambda: all(len(partial(queue, q.gid) or ()) >= 3 * n for q in qs), "checkpoints")
    saved = {q.gid: partial(queue, q.gid) for q in qs}
    assert not queue.r.lrange(keys.results("b1"), 0, -1), "the kill came after the answers: make them longer"
    for q in qs:
        toks = list(saved[q.gid].token_ids)
        assert 3 * n <= len(toks) < length and toks == reference(q.prompt, length, True)[0][: len(toks)]
    queue.r.zadd(keys.inflight("k"), {q.gid: 0 for q in qs}, xx=True)  # their leases lapse, as after a kill
    assert queue.requeue_expired("k") == 2
    assert make_worker(queue, "k").run(max_queries=2) == 2
    rows = {r.query_id: r for r in results(queue, "b1")}
    for q in qs:
        ids, text, prompt_tokens, _ = reference(q.prompt, length, True)
        row = rows[q.query_id]
        assert (row.text, row.completion_tokens, row.prompt_tokens, row.attempts) == (
            text,
            length,
            prompt_tokens,
            2,
        )


def test_every_row_exactly_once_through_two_preemptions(redis_url, reference):
    queue = WorkQueue(connect(redis_url))
    # long enough (400 tokens each) that the first cluster is seen decoding, polled every 10 ms, on any machine
    qs = [query(i, 400, forced=True) for i in range(10)]
    assert queue.create_batch("b1", [(q, "ab"[i % 2]) for i, q in enumerate(qs)])
    workers: dict[str, Worker] = {}
    threads: dict[str, threading.Thread] = {}

    def serve(cluster: str) -> None:
        own = WorkQueue(connect(redis_url))  # a client of its own, as each engine process has
        workers[cluster] = w = make_worker(own, cluster, checkpoint_tokens=8, lease_s=60.0)
        w.config.max_ahead = 2
        threads[cluster] = t = threading.Thread(target=w.run, daemon=True)
        t.start()

    noticed: list[str] = []

    def preempt(cluster: str) -> None:
        w = workers[cluster]
        decoding = lambda: w.engine_stats.running and w.engine_stats.generated_tokens >= 8  # noqa: E731
        # the first cluster surely decodes; the second may have answered all it held by the time it is asked
        # (a fast machine): then its notice finds nothing running, and the rows must still come once
        done = lambda: not queue.inflight_ids(cluster) and queue.r.zcard(keys.queue(cluster)) == 0  # noqa: E731
        wait_until(lambda: decoding() or done(), 120, f"{cluster} decoding or done", interval=0.01)
        noticed.append(cluster if decoding() else f"{cluster} (idle)")
        queue.give_notice(cluster, 0)
        threads[cluster].join(timeout=120)
        assert not threads[cluster].is_alive()
        off = Offloader(queue)
        wait_until(lambda: off.tick() >= 0 and queue.r.zcard(keys.queue(cluster)) == 0, 60, "the queue moved")

    try:
        serve("a")
        serve("b")
        preempt("a")
        queue.set_cluster_state("a", "active")  # the spot cluster is back
        serve("a")
        preempt("b")
        wait_until(lambda: queue.result_count("b1") >= len(qs), 180, "every row answered")
    finally:
        for c, w in workers.items():
            w.stop()
            threads[c].join(timeout=60)
    rows = results(queue, "b1")
    assert sorted(r.query_id for r in rows) == sorted(q.query_id for q in qs)  # every row, once
    for r in rows:
        q = qs[int(r.query_id[1:])]
        assert (r.finish_reason, r.completion_tokens, r.text) == (
            "length",
            400,
            reference(q.prompt, 400, True)[1],
        )
    assert queue.batch("b1").status == "completed"
    assert check(queue.r) == []
    assert noticed[0] == "a", noticed  # the first notice found queries running


def test_a_checkpoint_sent_again_releases_nothing_more_and_a_stale_one_writes_nothing(redis_url):
    """A CHECKPOINT whose reply was lost is sent again by the tick: it takes no second attempt back. One from a
    worker that no longer holds the query (another claimed it since) leaves the newer run's partial output alone."""
    queue = WorkQueue(connect(redis_url))
    assert queue.create_batch("b1", [(query(0, 48), "a")])
    [cq] = queue.claim("a", 1, "w1", 30.0)
    mine = [(cq.query.gid, Partial((1, 2, 3)), True)]
    assert queue.checkpoint("a", "w1", mine) == [True]
    assert queue.checkpoint("a", "w1", mine) == [True]  # the resend: same partial output, nothing released
    assert queue.r.hget(keys.query(cq.query.gid), "attempts") == "0"
    [again] = queue.claim("a", 1, "w2", 30.0)
    assert again.partial == Partial((1, 2, 3)) and again.attempts == 1
    assert queue.checkpoint("a", "w1", [(cq.query.gid, Partial((9,)), True)]) == [False]  # w1's: too late
    assert partial(queue, cq.query.gid) == Partial((1, 2, 3))
    assert queue.r.hget(keys.query(cq.query.gid), "attempts") == "1"
    assert queue.r.zscore(keys.inflight("a"), cq.query.gid) is not None  # still w2's


def test_sigterm_under_grace_s_checkpoints_and_the_engine_exits(redis_url, tmp_path):
    """A real engine process served with --grace-s: SIGTERM is a notice (here shorter than any query's time
    left), so it checkpoints its running queries, gives them back without using an attempt and exits."""
    queue = WorkQueue(connect(redis_url))
    qs = [query(i, 400, forced=True) for i in range(2)]
    assert queue.create_batch("b1", [(q, "k") for q in qs])
    args = ("--arch", "llama", "--size", "nano", "--checkpoint-tokens", "8", "--grace-s", "0.2")
    proc = start_engine("k", redis_url, tmp_path, *args)
    try:
        wait_until(lambda: all(len(partial(queue, q.gid) or ()) >= 8 for q in qs), 120, "decoding")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for q in qs:
        h = queue.r.hgetall(keys.query(q.gid))
        assert h["state"] == "queued" and h["attempts"] == "0"
        assert 8 <= len(partial(queue, q.gid)) < 400
    assert (
        queue.cluster_state("k") == "active"
    )  # the engine's own notice: the cluster's state is the gateway's


def test_rebalance_preempt_gives_the_cluster_notice(redis_url, capsys):
    from gateway.cli import main
    from gateway.config import ClusterSpec, GatewayConfig
    from tests.harness import GatewayThread

    token = "preempt-token"
    config = GatewayConfig(
        redis_url=redis_url,
        admin_token=token,
        offload=False,
        clusters=[ClusterSpec("a", capacity_tps=100), ClusterSpec("b", capacity_tps=100)],
    )
    g = GatewayThread(config)
    target = g.start()
    queue = WorkQueue(connect(redis_url))
    try:
        assert queue.create_batch("b1", [(query(i, 16), "a") for i in range(4)])
        base = ["rebalance", "--target", target, "--token", token]
        assert main([*base, "--preempt", "a", "--notice", "30"]) == 0  # a dry run: nothing changes
        assert queue.cluster_state("a") == "active" and queue.r.zcard(keys.queue("a")) == 4
        assert main([*base, "--preempt", "a", "--notice", "30", "--apply"]) == 0
        assert "applied: moved 4 queries" in capsys.readouterr().out
        assert queue.cluster_state("a") == "draining" and queue.r.zcard(keys.queue("b")) == 4
        state, left = parse_state(queue.state_call("a").run())
        assert state == "draining" and 0 < left <= 30
        assert queue.claim("a", 1, "w", 10.0) == []
        assert make_worker(queue, "a").run() == 0  # an engine started under the notice claims nothing, stops
        assert main([*base, "--add", "a", "--update", "--capacity", "100", "--apply"]) == 0  # back again
        assert parse_state(queue.state_call("a").run()) == ("active", None)
    finally:
        g.stop()


def test_an_engine_that_cannot_resume_gives_its_queries_back_under_a_notice(redis_url):
    """The static backend writes no checkpoints; a notice aborts what will not finish and gives it back, no attempt
    used and no partial output: the query runs again from the start elsewhere."""
    from engines.static_engine import StaticBatchEngine

    queue = WorkQueue(connect(redis_url))
    qs = [query(i, 16) for i in range(3)]
    assert queue.create_batch("b1", [(q, "a") for q in qs])
    model, tok = load_or_build(None, arch="llama", size="nano")
    config = WorkerConfig(cluster="a", backend="static", record_observed=False, cancel_check_s=0.0)
    worker = Worker(queue, StaticBatchEngine(model, tok, max_batch=2), config)
    assert not worker.resumable and worker.checkpoints.every == 0
    claim_and_start(worker)
    assert sorted(worker.inflight) == sorted(q.gid for q in qs)
    queue.give_notice("a", 0)
    assert worker.agent.tick() and worker.checkpoints.noticed
    assert worker.run() == 0
    for q in qs:
        h = queue.r.hgetall(keys.query(q.gid))
        assert (h["state"], h["attempts"], partial(queue, q.gid)) == ("queued", "0", None)
    assert not queue.r.lrange(keys.results("b1"), 0, -1)
    assert check(queue.r) == []
