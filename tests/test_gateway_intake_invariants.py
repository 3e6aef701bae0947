"""Random interleavings of background intake with the queue's other clients keep the invariants.

Hypothesis drives acceptance of batches for background intake (some rows bad, failing alone),
intake steps by three replicas that take, lose (lapse) and retake per-batch intake leases,
lost intake lists (the rows not yet enqueued counted failed),
synchronous creations, claims, completions, requeues of lapsed leases, tail moves and cancels;
:func:`workqueue.invariants.check` (total = done + queued + running + not yet enqueued) runs
after every step, and no row is ever enqueued twice.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from gateway.checks.validation import Checked
from gateway.intake.background import Intake, IntakeSettings, encode_rows
from protos import fleetbatch_pb2 as pb
from tests.harness import examples
from workqueue import QueuedQuery, WorkQueue, connect, keys
from workqueue.batches import INTAKE, intake_key, intake_lease_key
from workqueue.invariants import check

CLUSTERS = ("a", "b", "c")


def make_machine(url: str) -> type[RuleBasedStateMachine]:
    class IntakeMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            redis.Redis.from_url(url).flushall()
            self.clients = [WorkQueue(connect(url)) for _ in range(3)]
            self.intakes = [
                Intake(
                    q,
                    lambda prompts: [float(len(p)) for p in prompts],
                    lambda loads, views: [CLUSTERS[len(ld.key) % 3] for ld in loads],
                    IntakeSettings(chunk=2 + k, land=1 + k),
                )
                for k, q in enumerate(self.clients)
            ]
            self.batches = 0
            self.enqueued: set[str] = set()  # gids ever queued by an intake step

        @initialize()
        def clusters(self) -> None:
            for c in CLUSTERS:
                self.clients[0].register_cluster(c, backend="native")

        def _pick(self, pick: int) -> str | None:
            return f"b{pick % self.batches}" if self.batches else None

        @rule(who=st.integers(0, 2), n=st.integers(1, 7), bad=st.sets(st.integers(0, 6)))
        def accept(self, who, n, bad) -> None:
            b = f"b{self.batches}"
            self.batches += 1
            req = pb.SubmitBatchRequest(batch_id=b)
            for i in range(n):
                req.queries.add(id="q" * (i + 1), prompt=f"p{i}", max_tokens=8)
            checked = Checked([3] * n, [8] * n, {i: "bad row" for i in bad if i < n})
            assert self.clients[who].accept_batch(b, encode_rows(req, checked), fingerprint=b)

        @rule(who=st.integers(0, 2), where=st.lists(st.sampled_from(CLUSTERS), min_size=1, max_size=4))
        def create(self, who, where) -> None:
            b = f"b{self.batches}"
            self.batches += 1
            qs = [(QueuedQuery(b, f"q{i}", "p", 8, 2, float(i + 1)), c) for i, c in enumerate(where)]
            assert self.clients[who].create_batch(b, qs)

        @rule(who=st.integers(0, 2), pick=st.integers(0, 30))
        def take(self, who, pick) -> None:
            b = self._pick(pick)
            if b:
                self.clients[who].take_intake(b, f"w{who}", 30.0)

        @rule(pick=st.integers(0, 30))
        def lapse(self, pick) -> None:
            b = self._pick(pick)
            if b:
                self.clients[0].r.delete(intake_lease_key(b))

        @rule(who=st.integers(0, 2), pick=st.integers(0, 30))
        def step(self, who, pick) -> None:
            b = self._pick(pick)
            if not b:
                return
            before = {g for c in CLUSTERS for g in self.clients[who].queued_ids(c)}
            n = self.intakes[who].step(b, f"w{who}")
            after = {g for c in CLUSTERS for g in self.clients[who].queued_ids(c)}
            new = {g for g in after - before if g.startswith(b + ":")}
            assert not new & self.enqueued, f"enqueued twice: {new & self.enqueued}"
            self.enqueued |= new
            if n < 0:
                assert not new

        @rule(who=st.integers(0, 2), pick=st.integers(0, 30))
        def lose_then_step(self, who, pick) -> None:
            """The intake list is lost (evicted, deleted); the next step fails its rows once."""
            b = self._pick(pick)
            if not b:
                return
            self.clients[who].r.delete(intake_key(b))
            assert self.intakes[who].step(b, f"w{who}") == 0
            assert self.clients[who].r.zscore(INTAKE, b) is None

        @rule(who=st.integers(0, 2), c=st.sampled_from(CLUSTERS), n=st.integers(1, 3), lapsed=st.booleans())
        def claim_and_finish(self, who, c, n, lapsed) -> None:
            got = self.clients[who].claim(c, n, f"w{who}", -5.0 if lapsed else 30.0)
            for cq in got[: max(0, len(got) - 1)]:
                q = cq.query
                self.clients[who].complete(
                    q.gid, {"batch_id": q.batch_id, "query_id": q.query_id}, "completed", 1
                )

        @rule(who=st.integers(0, 2), c=st.sampled_from(CLUSTERS))
        def requeue_lapsed(self, who, c) -> None:
            self.clients[who].requeue_expired(c)

        @rule(who=st.integers(0, 2), src=st.sampled_from(CLUSTERS), dst=st.sampled_from(CLUSTERS))
        def move(self, who, src, dst) -> None:
            self.clients[who].move_tail(src, dst, 2)

        @rule(who=st.integers(0, 2), pick=st.integers(0, 30))
        def cancel(self, who, pick) -> None:
            b = self._pick(pick)
            if b:
                self.clients[who].cancel_batch(b)

        @invariant()
        def holds(self) -> None:
            violations = check(self.clients[0].r)
            assert not violations, violations

    return IntakeMachine


def test_intake_interleavings_keep_the_invariants(redis_server):
    run_state_machine_as_test(
        make_machine(redis_server.url),
        settings=settings(max_examples=examples(50), stateful_step_count=40, deadline=None, print_blob=True),
    )


def test_a_finished_intake_leaves_nothing_behind(redis_url):
    q = WorkQueue(connect(redis_url))
    q.register_cluster("a")
    intake = Intake(
        q, lambda ps: [4.0] * len(ps), lambda loads, views: ["a"] * len(loads), IntakeSettings(chunk=3)
    )
    req = pb.SubmitBatchRequest(batch_id="x")
    for i in range(7):
        req.queries.add(id=f"q{i}", prompt="p", max_tokens=8)
    assert q.accept_batch("x", encode_rows(req, Checked([2] * 7, [8] * 7, {3: "too long"})), fingerprint="f")
    assert not q.accept_batch("x", encode_rows(req, Checked([2] * 7, [8] * 7)), fingerprint="f")
    assert intake.run_batch("x")
    assert sorted(q.queued_ids("a")) == sorted(f"x:q{i}" for i in range(7) if i != 3)
    info = q.batch("x")
    assert info.status == "in_progress" and info.failed == 1 and info.queries_per_cluster == {"a": 6}
    assert q.results("x")[0]["error"] == "invalid query: too long"
    payload = json.loads(q.r.hget(keys.query("x:q0"), "payload"))  # what engines read: a QueuedQuery
    assert json.dumps(asdict(QueuedQuery(**payload))) == q.r.hget(keys.query("x:q0"), "payload")
    assert not check(q.r)
    assert not [k for k in q.r.keys("*") if "intake" in k or "staging" in k]
