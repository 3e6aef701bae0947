"""Random interleavings of several clients on a real Redis keep the queue's invariants.

Hypothesis drives submit, claim (with live or already-lapsed leases, carrying the worker's
renewals or not), renew (plain, or a worker's reassert, which takes back its requeued queries),
requeue of lapsed leases, give-ups at a claim after max_attempts, completion (also late, by a
worker whose lease lapsed), tail moves, moves and failures of planned ids and cancel across three
clients; :func:`workqueue.invariants.check` runs after every step. A worker's held ids lapse, get
requeued, moved, claimed by others or finished before it reasserts them. Lapsed leases come from
negative lease times, not from sleeping.
"""

from __future__ import annotations

import json

import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from tests.harness import examples
from workqueue import QueryResult, QueuedQuery, WorkQueue, connect
from workqueue.invariants import check

CLUSTERS = ("a", "b", "c")


def make_machine(url: str) -> type[RuleBasedStateMachine]:
    class QueueMachine(RuleBasedStateMachine):
        claimed = Bundle("claimed")  # (client, gid) of every claim, live or lapsed since

        def __init__(self) -> None:
            super().__init__()
            redis.Redis.from_url(url).flushall()
            self.clients = [WorkQueue(connect(url)) for _ in range(3)]
            self.held: list[list[str]] = [[], [], []]  # gids each client claimed (maybe lapsed since)
            self.batches = 0

        @initialize()
        def clusters(self) -> None:
            for c in CLUSTERS:
                self.clients[0].register_cluster(c, backend="native")

        @rule(
            who=st.integers(0, 2),
            where=st.lists(st.sampled_from(CLUSTERS), min_size=2, max_size=6),
            tokens=st.integers(1, 50),
        )
        def submit(self, who, where, tokens) -> None:
            b = f"b{self.batches}"
            self.batches += 1
            qs = [(QueuedQuery(b, f"q{i}", "p", 8, tokens, float(i + 1)), c) for i, c in enumerate(where)]
            assert self.clients[who].create_batch(b, qs)

        @rule(
            target=claimed,
            who=st.integers(0, 2),
            c=st.sampled_from(CLUSTERS),
            n=st.integers(1, 3),
            lapsed=st.booleans(),
            carry=st.booleans(),
        )
        def claim(self, who, c, n, lapsed, carry):
            """A claim, carrying the worker's renewals (of whatever it held, on any cluster) or not."""
            renew = list(self.held[who]) if carry else []
            got = self.clients[who].claim(c, n, f"w{who}", -5.0 if lapsed else 30.0, renew=renew)
            self.held[who] += [cq.query.gid for cq in got]
            return multiple(*[(who, cq.query.gid) for cq in got])

        @rule(target=claimed, who=st.integers(0, 2), c=st.sampled_from(CLUSTERS), n=st.integers(1, 3))
        def claim_then_lapse(self, who, c, n):
            """A worker claims and stops renewing: another client requeues the lapsed leases."""
            got = self.clients[who].claim(c, n, f"w{who}", -5.0)
            self.clients[(who + 1) % 3].requeue_expired(c)
            return multiple(*[(who, cq.query.gid) for cq in got])

        @rule(who=st.integers(0, 2))
        def renew(self, who) -> None:
            for c in CLUSTERS:
                self.clients[who].renew(c, self.held[who], 30.0)

        @rule(who=st.integers(0, 2), c=st.sampled_from(CLUSTERS), lapsed=st.booleans())
        def reassert(self, who, c, lapsed) -> None:
            """The worker's keeper renews by worker id: its requeued queries still on c come back to it."""
            self.clients[who].renew(c, self.held[who], -5.0 if lapsed else 30.0, worker_id=f"w{who}")

        @rule(
            who=st.integers(0, 2), c=st.sampled_from(CLUSTERS), picks=st.lists(st.integers(0, 30), max_size=3)
        )
        def fail_planned_ids(self, who, c, picks) -> None:
            """Ids read from a queue (repeats, ones that left since) are failed only if still queued there."""
            seen = self.clients[who].queued_ids(c) + self.clients[who].inflight_ids(c)
            gids = [seen[p % len(seen)] for p in picks] if seen else []
            rows = {g: QueryResult(*g.split(":", 1), finish_reason="error", error="test") for g in gids}
            self.clients[who].fail_queued(c, rows)

        @rule(who=st.integers(0, 2), c=st.sampled_from(CLUSTERS))
        def requeue_lapsed(self, who, c) -> None:
            self.clients[who].requeue_expired(c)

        @rule(item=consumes(claimed), kind=st.sampled_from(["completed", "failed"]))
        def complete(self, item, kind) -> None:
            who, g = item
            if g in self.held[who]:
                self.held[who].remove(g)
            b, q = g.split(":", 1)
            result = json.dumps({"batch_id": b, "query_id": q, "finish_reason": "length"})
            self.clients[who].complete(g, json.loads(result), kind, 3)

        @rule(
            who=st.integers(0, 2),
            src=st.sampled_from(CLUSTERS),
            dst=st.sampled_from(CLUSTERS),
            n=st.integers(1, 3),
        )
        def move(self, who, src, dst, n) -> None:
            self.clients[who].move_tail(src, dst, n)

        @rule(
            who=st.integers(0, 2),
            src=st.sampled_from(CLUSTERS),
            dst=st.sampled_from(CLUSTERS),
            picks=st.lists(st.integers(0, 30), max_size=4),
        )
        def move_planned_ids(self, who, src, dst, picks) -> None:
            """Ids read from the queues (repeats, ids queued on dst, ones that left since) move only if on src."""
            seen = self.clients[who].queued_ids(src) + self.clients[who].queued_ids(dst)
            self.clients[who].move_ids(src, dst, [seen[p % len(seen)] for p in picks] if seen else [])

        @rule(who=st.integers(0, 2), pick=st.integers(0, 20))
        def cancel(self, who, pick) -> None:
            if self.batches:
                self.clients[who].cancel_batch(f"b{pick % self.batches}")

        @invariant()
        def holds(self) -> None:
            violations = check(self.clients[0].r)
            assert not violations, violations

    return QueueMachine


def test_random_interleavings_keep_the_invariants(redis_server):
    run_state_machine_as_test(
        make_machine(redis_server.url),
        settings=settings(max_examples=examples(60), stateful_step_count=40, deadline=None, print_blob=True),
    )
