"""Moving queued work (issue 31, findings 2, 6 and 10, and their review): misfits never block a
drain (however many), a removed cluster's query that fits nowhere is failed alone, lease
recovery and evacuation run with ``--no-offload``, and a move carries exactly the planned ids.

Real Redis, real gateways on loopback; clusters get ``max_query_tokens`` limits so that one
queued query fits on no cluster but its own.
"""

from __future__ import annotations

import grpc
import pytest

from gateway.assign.views import MAX_TAIL_READ
from gateway.config import ClusterSpec, GatewayConfig
from gateway.offload.offloader import OffloadConfig, Offloader
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, wait_until
from workqueue import QueuedQuery, WorkQueue, connect, keys
from workqueue.invariants import check

TOKEN = "moves-token"
MD = [("authorization", f"Bearer {TOKEN}")]


def small(i: int, batch: str = "b") -> QueuedQuery:
    """14 tokens (4 prompt + 10 predicted): fits everywhere."""
    return QueuedQuery(batch, f"q{i}", "p", 8, 4, 10.0)


def huge(qid: str, batch: str = "b") -> QueuedQuery:
    """504 tokens: fits only a cluster without a limit."""
    return QueuedQuery(batch, qid, "p", 8, 4, 500.0)


def fleet(queue: WorkQueue, *, big_state: str = "active") -> None:
    """``a`` (limit 100 tokens) and ``big`` (no limit), both alive."""
    queue.register_cluster("a", capacity_hint_tps=100, max_query_tokens=100)
    queue.register_cluster("big", capacity_hint_tps=100)
    for name in ("a", "big"):
        queue.heartbeat(name, ttl_s=60, tokens_per_s=100)
    if big_state != "active":
        queue.set_cluster_state("big", big_state)


def big_queue(queue: WorkQueue) -> None:
    """``big`` holds 10 small queries with one huge one in the middle (b:q0..q4, b:huge, b:q5..q9)."""
    rows = [(small(i), "big") for i in range(5)] + [(huge("huge"), "big")]
    rows += [(small(i), "big") for i in range(5, 10)]
    queue.create_batch("b", rows)


# ---------------------------------------------------------------- finding 2: misfits never block


@pytest.mark.parametrize("how", ["draining", "dead"])
def test_evacuation_moves_everything_but_a_misfit_and_keeps_the_misfit_where_it_is(redis_url, how, caplog):
    queue = WorkQueue(connect(redis_url))
    fleet(queue, big_state="active" if how == "dead" else how)
    big_queue(queue)
    if how == "dead":
        queue.r.delete(keys.heartbeat("big"))  # its heartbeat expired: the engine died
    Offloader(queue).tick()
    a, big = queue.clusters(["a", "big"])
    assert big.queue_length == 1 and queue.queued_ids("big") == ["b:huge"]
    assert sorted(queue.queued_ids("a")) == sorted(f"b:q{i}" for i in range(10))
    assert a.pending_tokens == 10 * 14 and big.pending_tokens == 504
    assert "b:huge" in caplog.text and "fit on no accepting cluster" in caplog.text
    assert check(queue.r) == []


@pytest.fixture
def admin_gateway(redis_url):
    config = GatewayConfig(
        redis_url=redis_url,
        admin_token=TOKEN,
        offload=False,
        clusters=[
            ClusterSpec("a", capacity_tps=100, max_query_tokens=100),
            ClusterSpec("big", capacity_tps=100),
        ],
    )
    g = GatewayThread(config)
    channel = grpc.insecure_channel(g.start())
    queue = WorkQueue(connect(redis_url))
    yield pb_grpc.AdminServiceStub(channel), queue
    channel.close()
    g.stop()


def test_removing_a_cluster_that_holds_a_query_nobody_else_can_take_is_refused_and_changes_nothing(
    admin_gateway,
):
    admin, queue = admin_gateway
    fleet(queue)
    big_queue(queue)
    with pytest.raises(grpc.RpcError) as e:
        admin.RemoveCluster(pb.RemoveClusterRequest(name="big"), metadata=MD)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "b:huge" in e.value.details()
    big = queue.clusters(["big"])[0]
    assert (big.state, big.queue_length) == ("active", 11)  # not removed, nothing moved
    # a dry run answers as the real call would, and changes nothing either
    with pytest.raises(grpc.RpcError) as e:
        admin.RemoveCluster(pb.RemoveClusterRequest(name="big", dry_run=True), metadata=MD)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "b:huge" in e.value.details()
    big = queue.clusters(["big"])[0]
    assert (big.state, big.queue_length) == ("active", 11)
    # once the misfit is gone (cancelled, finished), the cluster can be removed
    queue.complete("b:huge", {"batch_id": "b", "query_id": "huge", "finish_reason": "stop"})
    removed = admin.RemoveCluster(pb.RemoveClusterRequest(name="big"), metadata=MD)
    assert sum(m.moved for m in removed.moves) == 10
    assert queue.clusters(["big"])[0].state == "removed"
    assert check(queue.r) == []


def test_a_dry_run_remove_of_a_cluster_that_runs_queries_is_refused_as_the_real_call(admin_gateway):
    admin, queue = admin_gateway
    fleet(queue)
    queue.create_batch("b", [(small(0), "big")])
    queue.claim("big", 1, "w", lease_s=60)
    for dry_run in (True, False):
        with pytest.raises(grpc.RpcError) as e:
            admin.RemoveCluster(pb.RemoveClusterRequest(name="big", dry_run=dry_run), metadata=MD)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "running" in e.value.details()
    plan = admin.RemoveCluster(pb.RemoveClusterRequest(name="big", dry_run=True, force=True), metadata=MD)
    assert not plan.applied and queue.clusters(["big"])[0].state == "active"


def test_a_removed_clusters_query_that_fits_nowhere_is_failed_alone_once(redis_url, caplog):
    """Review of issue 31: a misfit that reached a removed cluster past RemoveCluster's check (deeper
    than it reads, or assigned just before the mark) would wait forever, as the removed cluster claims
    nothing. The offloader fails it alone with a clear error; the rest of the queue moves."""
    queue = WorkQueue(connect(redis_url))
    fleet(queue, big_state="removed")
    big_queue(queue)
    offloader = Offloader(queue)
    assert offloader.tick() == 10
    assert queue.queued_ids("big") == [] and len(queue.queued_ids("a")) == 10
    (row,) = queue.results("b")
    assert (row["query_id"], row["finish_reason"], row["cluster"]) == ("huge", "error", "big")
    assert "cluster big was removed" in row["error"] and "fits on no other active cluster" in row["error"]
    info = queue.batch("b")
    assert (info.failed, info.completed, info.status) == (1, 0, "in_progress")
    assert "b:huge" in caplog.text and "removed cluster big" in caplog.text
    assert queue.clusters(["big"])[0].pending_tokens == 0
    assert check(queue.r) == []
    assert offloader.tick() == 0 and len(queue.results("b")) == 1  # once


def test_a_removed_clusters_misfit_that_fits_on_a_dead_active_cluster_waits_for_it(redis_url):
    queue = WorkQueue(connect(redis_url))
    fleet(queue, big_state="removed")
    queue.register_cluster("big2", capacity_hint_tps=100)  # no limit, but its engine is down
    big_queue(queue)
    Offloader(queue).tick()
    assert queue.queued_ids("big") == ["b:huge"] and queue.results("b") == []
    assert check(queue.r) == []


def test_remove_with_a_misfit_deeper_than_the_check_reads_fails_it_and_evacuates_the_rest(admin_gateway):
    admin, queue = admin_gateway
    fleet(queue)
    n = MAX_TAIL_READ + 100
    rows = [(huge("huge"), "big")] + [(small(i), "big") for i in range(n)]  # the misfit at the head
    assert queue.create_batch("b", rows)
    removed = admin.RemoveCluster(pb.RemoveClusterRequest(name="big"), metadata=MD)  # its check passes
    assert sum(m.moved for m in removed.moves) == MAX_TAIL_READ
    offloader = Offloader(queue, OffloadConfig(evacuate_chunk=5000))
    for _ in range(20):
        if not queue.queued_ids("big"):
            break
        offloader.tick()
    assert queue.queued_ids("big") == []
    (row,) = queue.results("b")
    assert row["query_id"] == "huge" and "cluster big was removed" in row["error"]
    assert queue.clusters(["a"])[0].queue_length == n
    assert check(queue.r) == []


def test_evacuation_reads_past_any_number_of_misfits(redis_url):
    """More misfits than one read holds (the offloader read at most 20,000 ids from the back) must not
    block the queries in front of them."""
    queue = WorkQueue(connect(redis_url))
    fleet(queue, big_state="draining")
    rows = [(small(i), "big") for i in range(10)] + [(huge(f"h{i}"), "big") for i in range(MAX_TAIL_READ)]
    assert queue.create_batch("b", rows)
    offloader = Offloader(queue, OffloadConfig(evacuate_chunk=5000))
    for _ in range(20):
        if len(queue.queued_ids("a")) == 10:
            break
        offloader.tick()
    assert sorted(queue.queued_ids("a")) == sorted(f"b:q{i}" for i in range(10))
    assert queue.clusters(["big"])[0].queue_length == MAX_TAIL_READ and queue.results("b") == []
    assert check(queue.r) == []


def test_draining_a_cluster_moves_the_rest_and_names_the_query_that_stays(admin_gateway):
    admin, queue = admin_gateway
    fleet(queue)
    big_queue(queue)
    drained = admin.DrainCluster(pb.DrainClusterRequest(name="big"), metadata=MD)
    assert sum(m.moved for m in drained.moves) == 10
    assert "b:huge" in drained.message
    a, big = queue.clusters(["a", "big"])
    assert (a.queue_length, big.queue_length, big.state) == (10, 1, "draining")
    assert check(queue.r) == []


# ---------------------------------------------------------------- finding 6: --no-offload


def test_with_offload_off_the_gateway_still_requeues_lapsed_leases_and_evacuates_dead_clusters(redis_url):
    queue = WorkQueue(connect(redis_url))
    queue.register_cluster("solo", capacity_hint_tps=100)
    queue.register_cluster("live", capacity_hint_tps=100)
    queue.register_cluster("dead", capacity_hint_tps=100)
    queue.heartbeat("solo", ttl_s=60, tokens_per_s=100)
    queue.create_batch("b", [(small(0), "solo"), (small(1), "dead"), (small(2), "dead")])
    queue.heartbeat("live", ttl_s=60, tokens_per_s=100)  # dead never heartbeats: not accepting
    assert [c.query.gid for c in queue.claim("solo", 1, "worker-that-dies", lease_s=0.0)] == ["b:q0"]
    g = GatewayThread(
        GatewayConfig(
            redis_url=redis_url,
            offload=False,
            offload_interval_s=0.05,
            clusters=[ClusterSpec(n, capacity_tps=100) for n in ("solo", "live", "dead")],
        )
    )
    g.start()
    try:
        wait_until(lambda: queue.queued_ids("solo") == ["b:q0"], 30, "the lapsed lease requeued")
        wait_until(lambda: queue.clusters(["dead"])[0].queue_length == 0, 30, "the dead queue evacuated")
        assert queue.queued_ids("live") == ["b:q1", "b:q2"]
    finally:
        g.stop()
    assert check(queue.r) == []


def test_with_offload_off_live_clusters_keep_their_queues(redis_url):
    queue = WorkQueue(connect(redis_url))
    for name in ("busy", "idle"):
        queue.register_cluster(name, capacity_hint_tps=100)
        queue.heartbeat(name, ttl_s=60, tokens_per_s=100)
    queue.create_batch("b", [(QueuedQuery("b", f"q{i}", "p", 8, 4, 96.0), "busy") for i in range(50)])
    assert Offloader(queue, OffloadConfig(balance=False)).tick() == 0
    assert queue.clusters(["busy"])[0].queue_length == 50
    assert Offloader(queue).tick() > 0  # with balancing on, the idle cluster takes some


# ---------------------------------------------------------------- finding 10: the planned ids move


class AppendsBeforeMoving(WorkQueue):
    """A queue where a huge query lands on ``busy``'s tail between the offloader's plan and its move."""

    appended = False

    def _append_once(self) -> None:
        if not self.appended:
            self.appended = True
            self.create_batch("late", [(huge("big-late", batch="late"), "busy")])

    def move_tail(self, src: str, dst: str, n: int) -> tuple[int, float]:
        self._append_once()
        return super().move_tail(src, dst, n)

    def move_ids(self, src: str, dst: str, gids, window=None) -> tuple[int, float]:
        self._append_once()
        return super().move_ids(src, dst, gids, window)

    def move_many(self, moves) -> list[tuple[int, float]]:  # the offloader's moves, one pipeline a tick
        self._append_once()
        return super().move_many(moves)


def test_the_offloader_moves_the_ids_it_planned_not_whatever_is_at_the_tail(redis_url):
    queue = AppendsBeforeMoving(connect(redis_url))
    queue.register_cluster("busy", capacity_hint_tps=100)
    queue.register_cluster("idle", capacity_hint_tps=100, max_query_tokens=200)
    for name in ("busy", "idle"):
        queue.heartbeat(name, ttl_s=60, tokens_per_s=100)
    queue.create_batch("b", [(QueuedQuery("b", f"q{i}", "p", 8, 4, 96.0), "busy") for i in range(50)])
    moved = Offloader(queue).tick()
    assert queue.appended and moved > 0
    on_idle = queue.queued_ids("idle")
    assert "late:big-late" not in on_idle, "a query that does not fit idle was moved there"
    assert on_idle == [f"b:q{i}" for i in range(50 - len(on_idle), 50)]  # the planned tail, in order
    assert queue.queued_ids("busy")[-1] == "late:big-late"
    assert check(queue.r) == []


def test_move_ids_moves_exactly_the_ids_still_queued_on_the_source(redis_url):
    queue = WorkQueue(connect(redis_url))
    for name in ("a", "b"):
        queue.register_cluster(name, capacity_hint_tps=100)
    queue.create_batch("x", [(small(i, batch="x"), "a") for i in range(6)])
    queue.claim("a", 1, "w", lease_s=60)  # x:q0 left the queue: it runs
    moved, tokens = queue.move_ids("a", "b", ["x:q0", "x:q4", "x:q2", "x:nope"])
    assert (moved, tokens) == (2, 28.0)
    assert queue.queued_ids("a") == ["x:q1", "x:q3", "x:q5"]
    assert queue.queued_ids("b") == ["x:q2", "x:q4"]  # in their order on the source
    assert queue.move_ids("a", "b", []) == (0, 0.0)
    assert queue.move_ids("a", "b", ["x:q1"], window=2) == (0, 0.0)  # not among the last 2: stays
    assert queue.move_ids("a", "b", ["x:q1", "x:q1"], window=3) == (1, 14.0)  # a repeat moves once
    assert queue.queued_ids("a") == ["x:q3", "x:q5"]
    assert check(queue.r) == []
