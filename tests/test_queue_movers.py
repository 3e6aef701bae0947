"""One mover at a time (R7): offloaders of several gateway replicas and admin rebalance share a lease."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from gateway.config import ClusterSpec, GatewayConfig
from gateway.offload.offloader import Offloader
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, wait_until
from workqueue import QueuedQuery, WorkQueue, connect
from workqueue.invariants import check


def test_the_lease_is_exclusive_lapses_and_is_released_only_by_its_holder(redis_url):
    a, b = WorkQueue(connect(redis_url)), WorkQueue(connect(redis_url))
    with a.mover_lease("a") as held_a:
        assert held_a
        with b.mover_lease("b") as held_b:
            assert not held_b
    with b.mover_lease("b") as held_b:  # a gave it back
        assert held_b
    short = a.mover_lease("a", ttl_s=0.05)
    assert short.acquire()
    other = b.mover_lease("b", wait_s=10)
    assert other.acquire()  # a's lease lapsed (a died holding it): b gets it after waiting
    short.release()  # a comes back late: it must not delete b's lease
    assert other.holder() == other.token
    other.release()
    assert other.holder() is None


class SlowMoves(WorkQueue):
    """A queue whose moves take a while and record how many run at once."""

    active = 0
    most = 0
    lock = threading.Lock()

    def _slowly(self, move):
        with SlowMoves.lock:
            SlowMoves.active += 1
            SlowMoves.most = max(SlowMoves.most, SlowMoves.active)
        time.sleep(0.2)
        try:
            return move()
        finally:
            with SlowMoves.lock:
                SlowMoves.active -= 1

    def move_ids(self, src: str, dst: str, gids, window=None) -> tuple[int, float]:
        return self._slowly(lambda: super(SlowMoves, self).move_ids(src, dst, gids, window))

    def move_many(self, moves) -> list[tuple[int, float]]:  # the offloader's moves, one pipeline a tick
        return self._slowly(lambda: super(SlowMoves, self).move_many(moves))


def test_two_offloaders_ticking_at_once_do_not_both_move_the_same_surplus(redis_url):
    setup = WorkQueue(connect(redis_url))
    for name in ("busy", "idle"):
        setup.register_cluster(name, capacity_hint_tps=100)
        setup.heartbeat(name, ttl_s=60, tokens_per_s=100)
    setup.create_batch("b", [(QueuedQuery("b", f"q{i}", "p", 8, 4, 96.0), "busy") for i in range(200)])
    offloaders = [Offloader(SlowMoves(connect(redis_url))) for _ in range(2)]
    start = threading.Barrier(2)
    moved = [0, 0]

    def run(k: int) -> None:
        start.wait()
        moved[k] = offloaders[k].tick()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert SlowMoves.most == 1
    assert 0 in moved and 90 <= sum(moved) <= 110  # one planner moved about half, not twice that
    wait_until(lambda: setup.mover_lease("check").holder() is None, 10, "the lease given back")
    assert check(setup.r) == []


def test_an_applied_rebalance_waits_for_the_mover_lease_and_says_who_holds_it(redis_url):
    config = GatewayConfig(
        redis_url=redis_url,
        admin_token="t",
        offload=False,
        clusters=[ClusterSpec("a", capacity_tps=100), ClusterSpec("b", capacity_tps=100)],
    )
    g = GatewayThread(config)
    channel = grpc.insecure_channel(g.start())
    admin = pb_grpc.AdminServiceStub(channel)
    md = [("authorization", "Bearer t")]
    try:
        lease = WorkQueue(connect(redis_url)).mover_lease("offloader-elsewhere", ttl_s=60)
        # the gateway's own recovery loop (it runs with offload off too) holds the lease for a moment each tick
        wait_until(
            lease.acquire, 30, "the gateway's recovery tick to let go of the mover lease", interval=0.01
        )
        assert (
            admin.Rebalance(pb.RebalanceRequest(dry_run=True), metadata=md).applied is False
        )  # no lease needed
        with pytest.raises(grpc.RpcError) as e:
            admin.Rebalance(pb.RebalanceRequest(dry_run=False), metadata=md)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "offloader-elsewhere" in e.value.details()
        lease.release()
        assert admin.Rebalance(pb.RebalanceRequest(dry_run=False), metadata=md).applied
    finally:
        channel.close()
        g.stop()
