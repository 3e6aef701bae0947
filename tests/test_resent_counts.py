"""A write resent after its reply was lost counts once (issue 48, finding 7): the observed lengths a worker's
tick records for predictor retraining, and the failed passes the OpenAI finalizer counts. A real Redis; the
reply is lost in the client's connection after Redis ran the call, so redis-py sends the call again."""

from __future__ import annotations

from gateway.http_api.batches import record_key
from gateway.http_api.finalizer import Finalizer
from tests.lost_reply import losing_client
from workqueue import Observation, WorkQueue, keys
from workqueue.worker_tick import TickRequest, run_tick


def test_observed_lengths_resent_with_a_tick_are_recorded_once(redis_server):
    r, lossy = losing_client(redis_server.socket_file, marker=b"a-prompt-whose-tick-reply-is-lost")
    r.flushall()
    q = WorkQueue(r)
    q.register_cluster("a")
    seen = [Observation("a-prompt-whose-tick-reply-is-lost", 7, cluster="a"), Observation("another", 9)]
    run_tick(q, TickRequest("a", "w", 60.0, observed=seen, read_state=False))
    assert lossy.lost == 1  # the fault bit: the tick ran and its reply never came
    assert [Observation.from_json(x).length for x in r.lrange(keys.OBSERVED, 0, -1)] == [7, 9]
    run_tick(q, TickRequest("a", "w", 60.0, observed=seen[:1], read_state=False))  # a new tick: counted
    assert r.llen(keys.OBSERVED) == 3


def test_a_finalizer_failure_resent_is_counted_once(redis_server, tmp_path):
    r, lossy = losing_client(redis_server.socket_file, marker=b"'finalize_retry_at', ARGV[1]")
    r.flushall()
    q = WorkQueue(r)
    r.hset(record_key("b1"), mapping={"created_at": 1.0, "input_file_id": "file-x"})
    r.hset(keys.batch("b1"), "status", "completed")
    finalizer = Finalizer(q, store=None, clock=lambda: 1000.0)  # type: ignore[arg-type]
    finalizer.failed("b1", OSError("disk full"))
    assert lossy.lost == 1  # the fault bit: the count ran and its reply never came
    assert r.hget(record_key("b1"), "finalize_failures") == "1"
    lossy.losses = 0
    finalizer.failed("b1", OSError("disk full"))  # a second failed pass counts
    assert r.hget(record_key("b1"), "finalize_failures") == "2"
