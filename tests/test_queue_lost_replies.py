"""A reply lost after Redis ran the command (issue [4/7], finding 2): the call redis-py sends again must not
change what the first one did. A real Redis; the reply is lost in the client's connection after the server
answered, so redis-py resends the call, as it does when a reset or a stall eats a reply on a network."""

from __future__ import annotations

from gateway.checks.validation import Checked
from gateway.intake.background import encode_rows
from protos import fleetbatch_pb2 as pb
from tests.lost_reply import losing_client
from tests.test_queue_faults import queries
from workqueue import WorkQueue, keys
from workqueue.invariants import check
from workqueue.records import QueryResult
from workqueue.scripts import RESENT


def _rows(batch_id: str, n: int) -> list[str]:
    req = pb.SubmitBatchRequest(batch_id=batch_id)
    for i in range(n):
        req.queries.add(id=f"q{i}", prompt=f"{batch_id} {i}", max_tokens=8)
    return encode_rows(req, Checked(prompt_tokens=[5] * n, max_tokens=[8] * n))


def test_a_resent_staging_write_stages_its_rows_once_and_the_batch_is_accepted(redis_server):
    r, lossy = losing_client(redis_server.socket_file, marker=b'"prompt":"b1 15"')  # the second chunk's write
    r.flushall()
    q = WorkQueue(r)
    assert q.accept_batch("b1", _rows("b1", 30), chunk=10, fingerprint="")
    assert lossy.lost == 1  # the fault bit: one staging write ran and its reply never came
    info = q.batch("b1")
    assert info.status == "validating" and info.total == 30
    assert r.llen(keys.intake("b1")) == 30  # each row once, none doubled
    assert check(r) == []


def test_a_claim_resent_after_its_reply_was_lost_hands_out_the_same_queries_once(redis_server):
    """Finding 1: the worker saw only the resent CLAIM's reply, so the first run's queries ran nowhere, were
    requeued when their lease lapsed, and lost an attempt each."""
    r, lossy = losing_client(redis_server.socket_file, marker=b"worker-with-a-lossy-link")
    r.flushall()
    q = WorkQueue(r, max_attempts=3)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 6)])
    claimed = q.claim("a", 2, "worker-with-a-lossy-link", 60)
    assert lossy.lost == 1  # the fault bit: the claim ran and its reply never came
    gids = sorted(c.query.gid for c in claimed)
    assert gids == sorted(q.inflight_ids("a"))  # it runs exactly what is in flight for it
    assert len(q.queued_ids("a")) == 4 and all(c.attempts == 1 for c in claimed)
    assert check(r) == []


def test_a_result_write_resent_after_its_reply_was_lost_is_told_from_a_second_run(redis_server):
    """The worker logged a resent write as "already had a result (it ran twice)": the resent call now answers
    RESENT (-2), a second run's result (another write) still answers -1, and the result is kept once."""
    r, lossy = losing_client(redis_server.socket_file, marker=b"the-answer-text")
    r.flushall()
    q = WorkQueue(r)
    assert q.create_batch("b1", [(x, "a") for x in queries("b1", 2)])
    (first, second) = q.claim("a", 2, "w", 60)
    result = QueryResult("b1", first.query.query_id, text="the-answer-text", finish_reason="stop")
    assert q.complete(first.query.gid, result) == RESENT
    assert lossy.lost == 1  # the fault bit: the write ran and its reply never came
    again = QueryResult("b1", first.query.query_id, text="another run", finish_reason="stop")
    assert q.complete(first.query.gid, again) == -1  # a second run: the first result stays
    assert [x["text"] for x in q.results("b1")] == ["the-answer-text"]
    assert check(r) == []
