"""Background intake while batches wait for a cluster (review of issue 31's intake), on a real Redis.

* A chunk that waits for a restarting cluster is counted and predicted once: every poll
  after that only places it again, until it lands, fails at the bound, or its batch is
  cancelled (then its rows are cancelled, not placed). The kept chunk is dropped once the
  batch moves on, here or on another replica.
* A tick pages through every batch in intake, so batches behind a full page of waiting ones
  get their turns; a tick gives at most ``round_batches`` turns and the next resumes there.
* A batch's first turn reads only the rows it uses (``first_chunk``).
* One function says whether a query fits anywhere, for intake, assignment and drains.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.assign.policies import ClusterView, NoClusterError, QueryLoad, misfit
from gateway.assign.registry import make_policy
from gateway.checks.validation import Checked
from gateway.intake.background import Intake, IntakeSettings, encode_rows
from gateway.offload.rebalance import plan_moves
from protos import fleetbatch_pb2 as pb
from tests.harness import Clock, accept, enqueued, restarting
from workqueue import WorkQueue, connect, keys
from workqueue.invariants import check


class Predictor:
    """A real predictor function that counts its calls and the prompts it saw."""

    def __init__(self) -> None:
        self.calls = 0
        self.prompts = 0

    def __call__(self, prompts: list[str]) -> list[float]:
        self.calls += 1
        self.prompts += len(prompts)
        return [8.0] * len(prompts)


class ReadCounting(WorkQueue):
    """The real queue, remembering how many rows each intake read asked for."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list[int] = []

    def intake_state(self, batch_id: str, n: int, start: int = 0):
        self.reads.append(n)
        return super().intake_state(batch_id, n, start)


def intake(queue: WorkQueue, predict: Predictor, **settings) -> Intake:
    base = {"chunk": 10, "first_chunk": 10, "land": 10}
    return Intake(
        queue, predict, make_policy("least_loaded").assign, IntakeSettings(**(base | settings)), wait_s=60.0
    )


@pytest.fixture
def fleet(redis_url):
    """A queue on a hand-moved clock; 'small' alive (limit 50 tokens), 'big' restarting (limit 1000)."""
    clock = Clock()
    queue = ReadCounting(connect(redis_url), clock=clock)
    queue.register_cluster("small", capacity_hint_tps=100, max_query_tokens=50)
    queue.register_cluster("big", capacity_hint_tps=100, max_query_tokens=1000)
    queue.heartbeat("small", 3600.0)
    restarting(queue, "big")
    return queue, clock


def test_a_waiting_chunk_is_predicted_once_however_often_it_is_polled(fleet):
    queue, clock = fleet
    predict = Predictor()
    it = intake(queue, predict)
    accept(queue, "w", 4, prompt_tokens=200)  # only 'big' can take them
    for _ in range(6):
        assert it.tick() == 0
        clock.now += 5  # 30 s in all: within the 60 s bound
    assert predict.calls == 1 and predict.prompts == 4
    assert queue.batch("w").failed == 0 and enqueued(queue, "w") == 0
    queue.heartbeat("big", 3600.0)  # back: the kept chunk lands as it was predicted
    assert it.tick() == 4
    assert predict.calls == 1 and sorted(queue.queued_ids("big")) == [f"w:q{i}" for i in range(4)]
    assert it.waiting_batches() == 0 and not check(queue.r)


def test_a_later_chunk_that_waits_is_kept_and_the_rows_before_it_count_as_landed(fleet):
    queue, clock = fleet
    predict = Predictor()
    it = intake(queue, predict)
    req = pb.SubmitBatchRequest(batch_id="m")
    for i in range(20):
        req.queries.add(id=f"q{i}", prompt=f"m {i}", max_tokens=8)
    tokens = [5] * 10 + [200] * 10  # the first chunk fits 'small'; the second only 'big'
    assert queue.accept_batch("m", encode_rows(req, Checked(tokens, [8] * 20)), fingerprint="")
    assert it.tick() == 10 and predict.calls == 2 and it.waiting_batches() == 1
    clock.now += 30
    assert it.tick() == 0 and predict.calls == 2
    queue.heartbeat("big", 3600.0)
    assert it.tick() == 10 and predict.calls == 2 and enqueued(queue, "m") == 20
    assert len(queue.queued_ids("small")) == len(queue.queued_ids("big")) == 10
    assert it.waiting_batches() == 0 and not check(queue.r)


def test_with_no_cluster_alive_every_row_waits(fleet):
    queue, _ = fleet
    queue.r.delete(keys.heartbeat("small"))  # both restart now
    predict = Predictor()
    it = intake(queue, predict)
    accept(queue, "w", 3)  # fits either, once one is back
    assert it.tick() == 0 and it.tick() == 0 and predict.calls == 1
    assert queue.batch("w").failed == 0 and it.waiting_batches() == 1
    queue.heartbeat("small", 3600.0)
    assert it.tick() == 3 and len(queue.queued_ids("small")) == 3 and not check(queue.r)


def test_a_kept_chunk_still_fails_at_the_bound_without_a_new_prediction(fleet):
    queue, clock = fleet
    predict = Predictor()
    it = intake(queue, predict)
    accept(queue, "w", 3, prompt_tokens=200)
    assert it.tick() == 0
    clock.now += 61
    assert it.tick() == 3 and predict.calls == 1
    info = queue.batch("w")
    assert info.status == "failed" and info.failed == 3 and it.waiting_batches() == 0
    assert all("within 60 s" in r["error"] for r in queue.results("w"))
    assert not check(queue.r)


def test_a_waiting_batch_cancelled_meanwhile_has_its_rows_cancelled(fleet):
    queue, _ = fleet
    predict = Predictor()
    it = intake(queue, predict)
    accept(queue, "w", 4, prompt_tokens=200)
    assert it.tick() == 0
    queue.cancel_batch("w")
    assert it.tick() == 4
    info = queue.batch("w")
    assert info.final and info.cancelled == 4 and predict.calls == 1
    assert it.waiting_batches() == 0 and not check(queue.r)


def test_a_kept_chunk_is_dropped_once_another_replica_lands_it(fleet):
    queue, _ = fleet
    mine, theirs = Predictor(), Predictor()
    a, b = intake(queue, mine), intake(queue, theirs)
    accept(queue, "w", 4, prompt_tokens=200)
    assert a.tick() == 0 and a.waiting_batches() == 1
    queue.heartbeat("big", 3600.0)
    assert b.tick() == 4  # the other replica lands it
    assert a.tick() == 0 and a.waiting_batches() == 0  # gone from intake: the kept chunk goes too
    assert mine.calls == 1 and len(queue.queued_ids("big")) == 4 and not check(queue.r)


def test_a_batch_behind_a_full_page_of_waiting_batches_gets_its_turn(fleet):
    queue, clock = fleet
    predict = Predictor()
    it = intake(queue, predict)
    for i in range(100):  # a whole default page (100 ids) of batches that wait for 'big'
        accept(queue, f"w{i}", 1, prompt_tokens=200)
        clock.now += 0.001
    accept(queue, "late", 2)  # fits 'small', which is alive
    assert it.tick() == 2
    assert enqueued(queue, "late") == 2 and sorted(queue.queued_ids("small")) == ["late:q0", "late:q1"]
    assert predict.calls == 101
    assert it.tick() == 0 and predict.calls == 101  # the waiting ones are only placed again
    assert not check(queue.r)


def test_a_tick_gives_a_bounded_number_of_turns_and_the_next_resumes_after_them(fleet):
    queue, clock = fleet
    predict = Predictor()
    it = intake(queue, predict, page=2, round_batches=3)
    for i in range(5):
        accept(queue, f"b{i}", 1)
        clock.now += 1
    assert it.tick() == 3
    assert [enqueued(queue, f"b{i}") for i in range(5)] == [1, 1, 1, 0, 0]
    assert it.tick() == 2
    assert [enqueued(queue, f"b{i}") for i in range(5)] == [1] * 5
    assert it.tick() == 0 and not check(queue.r)


def test_a_first_turn_reads_only_the_rows_it_uses(fleet):
    queue, _ = fleet
    predict = Predictor()
    it = intake(queue, predict, chunk=40, first_chunk=4, land=40, turn=4)
    accept(queue, "f", 30)
    accept(queue, "g", 30)  # another batch in intake: each turn is the first chunk only
    assert it.tick() == 8 and enqueued(queue, "f") == enqueued(queue, "g") == 4
    assert queue.reads and max(queue.reads) == 4
    assert not check(queue.r)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "token"])
def test_one_rule_says_where_a_query_fits_for_intake_assignment_and_drains(policy):
    """Placement (configured clusters), the policies and drains (accepting clusters) all ask
    :func:`gateway.assign.policies.misfit`, so their answers and words cannot drift apart."""
    small = ClusterView("small", 100.0, max_query_tokens=50)
    big = ClusterView("big", 100.0, max_query_tokens=1000, accepting=False)  # restarting
    huge = QueryLoad("huge", 2000, 8.0)
    mid = QueryLoad("mid", 200, 8.0)
    with pytest.raises(NoClusterError) as e:
        make_policy(policy).assign([mid], [small, big])
    assert str(e.value) == misfit(mid, [small]) and "of any accepting cluster is 50" in str(e.value)
    configured = [small, replace(big, accepting=True)]
    assert misfit(mid, configured, "configured") is None  # waits for 'big': not a permanent misfit
    assert "of any configured cluster is 1000" in misfit(huge, configured, "configured")
    plan = plan_moves([small, big, ClusterView("c", 100.0)], {"c": [mid, huge]}, drain=["c"])
    assert [q.key for q in plan.kept["c"]] == ["mid", "huge"]  # both fit no accepting cluster
