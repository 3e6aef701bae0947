"""Completion windows at submit (refused, at risk or not, with the predicted finish) and the ETA that corrects
itself from the lengths it observes: a real gateway on loopback, a real Redis, the queue driven by hand."""

from __future__ import annotations

import grpc
import pytest

from gateway.assign.loads import PROMPT_WEIGHT, work_units
from gateway.checks.windows import WindowError, format_window, parse_window
from gateway.cli import main
from gateway.config import ClusterSpec, GatewayConfig
from gateway.status.eta import EtaBoard, Throughput, correction, estimate
from gateway.status.metrics import GatewayMetrics
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, batch_of, wait_until
from workqueue import BatchInfo, QueryResult, WorkQueue, connect


@pytest.fixture
def gateway(redis_url):
    config = GatewayConfig(redis_url=redis_url, policy="token", clusters=[ClusterSpec("a", capacity_tps=100)])
    g = GatewayThread(config)
    address = g.start()
    channel = grpc.insecure_channel(address)
    queue = WorkQueue(connect(redis_url))
    queue.heartbeat("a", ttl_s=600, tokens_per_s=0)  # alive: the ETA's capacity until a rate is measured
    yield pb_grpc.BatchServiceStub(channel), queue, address
    channel.close()
    g.stop()


def with_eta(stub, batch_id: str) -> pb.Batch | None:
    b = stub.GetBatch(pb.GetBatchRequest(batch_id=batch_id))
    return b if b.predicted_finish_at > 0 and b.remaining_tokens > 0 else None


def test_windows_and_priorities_parse_or_are_refused_by_name():
    assert [parse_window(w) for w in ("", "24h", "30m", "1h30m", "2d", "45s", "1.5h")] == [
        86400, 86400, 1800, 5400, 172800, 45, 5400
    ]  # fmt: skip
    for bad in ("tomorrow", "1 hour", "0s", "31d", "h", "-5m"):
        with pytest.raises(WindowError, match="completion_window"):
            parse_window(bad)
    assert [format_window(s) for s in (86400, 5400, 45, 172800)] == ["24h", "1h30m", "45s", "2d"]


def test_a_bad_window_or_priority_is_invalid_argument_and_creates_nothing(gateway):
    stub, queue, _ = gateway
    for kw in ({"completion_window": "soon"}, {"completion_window": "90d"}, {"priority": 101}):
        with pytest.raises(grpc.RpcError) as e:
            stub.SubmitBatch(batch_of(2, batch_id="bad", **kw))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("priority" if "priority" in kw else "completion_window") in e.value.details()
    assert queue.batch("bad") is None


def test_the_answer_at_submit_says_whether_the_window_fits(gateway, capsys):
    stub, queue, _ = gateway
    first = stub.SubmitBatch(batch_of(4, batch_id="first"))
    assert first.completion_window == "24h" and first.deadline == pytest.approx(
        first.created_at + 86400, abs=1
    )
    wait_until(lambda: with_eta(stub, "first"), 30, "a first ETA")
    tight = stub.SubmitBatch(batch_of(40, batch_id="tight", completion_window="1s", priority=3))
    assert (
        tight.at_risk and tight.predicted_finish_at > tight.deadline
    )  # 40 queries at 100 tokens/s: not in 1 s
    assert (tight.priority, tight.completion_window) == (3, "1s")
    loose = stub.SubmitBatch(batch_of(40, batch_id="loose", completion_window="2d"))
    assert not loose.at_risk and first.created_at < loose.predicted_finish_at < loose.deadline
    assert loose.predicted_tokens == pytest.approx(
        sum(queue.batch("loose").predicted_tokens_per_cluster.values())
    )
    wait_until(lambda: with_eta(stub, "tight"), 30, "the tight batch's ETA")
    assert (
        main(["status", "--target", gateway[2], "--token", "-", "--batch-id", "tight", "--batch-id", "loose"])
        == 0
    )
    table = capsys.readouterr().out.splitlines()
    tight_row = next(line for line in table if line.startswith("tight"))
    assert "in_progress" in tight_row and "0/40" in tight_row and tight_row.endswith("yes")
    assert next(line for line in table if line.startswith("loose")).endswith("no")


def test_the_eta_grows_when_answers_run_longer_than_predicted(gateway):
    stub, queue, _ = gateway
    stub.SubmitBatch(batch_of(60, batch_id="long"))
    before = wait_until(lambda: with_eta(stub, "long"), 30, "an ETA")
    claimed = queue.claim("a", 30, "w", 60)
    for cq in claimed:  # a served model whose answers run 4x the predictions (prompt tokens as counted)
        q = cq.query
        completion = round(q.predicted_tokens * 4)
        result = QueryResult(q.batch_id, q.query_id, text="x", prompt_tokens=q.prompt_tokens,
                             completion_tokens=completion, finish_reason="stop")  # fmt: skip
        queue.complete(q.gid, result, "completed", completion)

    changed = lambda: (b := with_eta(stub, "long")) and b.remaining_tokens != before.remaining_tokens and b  # noqa: E731
    after = wait_until(changed, 30, "an ETA after the answers")
    left = sum(queue.batch("long").left_tokens_per_cluster.values())
    assert after.done_actual_tokens > 2 * after.done_predicted_tokens
    assert after.remaining_tokens > 1.3 * left  # the rest is expected to run long too (uncorrected: 1.0 x)
    assert after.remaining_tokens < before.remaining_tokens  # yet half the rows are done


def info(batch_id: str, key: float, left: float, done_pred: float = 0.0, done_actual: int = 0, deadline=0.0):
    return BatchInfo(
        batch_id, "in_progress", 10, 0, 0, 0, 0.0, 0.0, predicted_tokens_per_cluster={"a": left + done_pred},
        deadline=deadline, order_key=key, done_predicted_tokens=done_pred, done_actual_tokens=done_actual,
        left_tokens_per_cluster={"a": left},
    )  # fmt: skip


def test_the_eta_rule_counts_the_work_ahead_and_the_observed_lengths():
    batches = [info("later", 200.0, 1000), info("sooner", 100.0, 500, 500, 1500, deadline=105.0)]
    etas = estimate(
        batches, now=100.0, rate=100.0, prompt_share=0.0
    )  # all generated tokens: work units as they are
    k = correction(1500, 500, 1.0)
    assert etas["sooner"].correction == pytest.approx(k) and 1.3 < k < 3  # shrunk toward 1 from 3
    assert etas["sooner"].finish_at == pytest.approx(100 + 500 * k / 100)  # nothing ahead of it
    assert etas["sooner"].at_risk and not etas["later"].at_risk
    assert etas["later"].finish_at == pytest.approx(100 + (500 * k + 1000) / 100)  # behind the sooner one
    assert etas["sooner"].progress == pytest.approx(0.5)
    assert correction(10**7, 10**7 / 2, 1.0) == pytest.approx(
        2.0, rel=1e-3
    )  # much evidence: the observed ratio


def test_the_throughput_counts_from_the_first_completion_not_from_the_idle_start():
    t = Throughput()
    for now, total in ((0, 0), (1, 0), (2, 0), (3, 100), (4, 200), (5, 300)):
        t.observe(now, total)
    assert t.rate() == pytest.approx(100.0)  # 3 s of waiting for the first answers do not count
    t.reset()
    assert t.rate() is None


def test_capacities_count_generated_tokens_and_the_eta_converts_them_to_prompt_plus_completion():
    """Heartbeats and plans measure decoding (generated tokens/s); the work is prompt + completion tokens. Before a
    rate is measured, the board converts the capacity at the answered rows' prompt share (a prompt token weighs
    PROMPT_WEIGHT of a generated one)."""
    assert work_units(0.0) == 1.0 and work_units(1.0) == pytest.approx(PROMPT_WEIGHT)
    board = EtaBoard()
    etas = board.update(0.0, [info("b", 1.0, 3000)], 3000, 3000, capacity_tps=100.0, finished_completion=1000)
    units = work_units(2 / 3)  # 2,000 of the answered rows' 3,000 tokens were prompt
    assert (
        board.rate_tps == pytest.approx(100.0 / units) and board.rate_tps > 200
    )  # was 100: ETAs 2.5x too late
    assert etas["b"].finish_at == pytest.approx(3000 * units / 100.0)


def test_the_gauges_show_each_unfinished_batchs_eta_and_progress_and_the_count_at_risk():
    m = GatewayMetrics()
    etas = estimate([info("late", 1.0, 1000, 500, 600, deadline=101.0), info("fine", 2.0, 10)], 100.0, 100.0)
    m.observe_etas(etas, 100.0)
    value = m.registry.get_sample_value
    assert value("fleetbatch_batch_eta_seconds", {"batch": "late"}) == pytest.approx(
        etas["late"].finish_at - 100
    )
    assert value("fleetbatch_batch_token_progress", {"batch": "late"}) == pytest.approx(500 / 1500)
    assert value("fleetbatch_batches_at_risk") == 1
    m.observe_etas({"fine": etas["fine"]}, 100.0)  # "late" finished: its series go
    assert value("fleetbatch_batch_eta_seconds", {"batch": "late"}) is None
    assert value("fleetbatch_batches_at_risk") == 0


def test_a_batch_that_turns_at_risk_is_logged_once(caplog):
    """Large batches answer before their rows are predicted (background intake): the board logs each batch the tick
    it is first predicted to miss its deadline, so no miss is silent."""
    board = EtaBoard()
    batches = [info("big", 1.0, 10_000, deadline=50.0), info("ok", 2.0, 10)]
    with caplog.at_level("WARNING", logger="gateway.status.eta"):
        board.update(0.0, batches, 0, 0, capacity_tps=100.0)
        board.update(0.5, batches, 0, 0, capacity_tps=100.0)
    warned = [r.getMessage() for r in caplog.records if "at risk" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("batch big is at risk")


def test_rows_still_in_intake_count_at_the_mean_of_those_landed():
    b = info("big", 1.0, 400)  # 10 rows, 400 predicted tokens of the 4 landed: 100 each
    b.intake_left = 6
    assert estimate([b], 0.0, 100.0, prompt_share=0.0)["big"].remaining_tokens == pytest.approx(1000)
    b.intake_left = 10  # nothing landed: nothing to go by yet
    assert estimate([b], 0.0, 100.0, prompt_share=0.0) == {}


def test_a_retry_with_another_window_or_priority_is_refused(gateway):
    stub, _, _ = gateway
    first = stub.SubmitBatch(batch_of(2, batch_id="same", completion_window="1h"))
    assert stub.SubmitBatch(batch_of(2, batch_id="same", completion_window="1h")).deadline == first.deadline
    for kw in ({"completion_window": "2h"}, {"completion_window": "1h", "priority": 1}):
        with pytest.raises(grpc.RpcError) as e:
            stub.SubmitBatch(batch_of(2, batch_id="same", **kw))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "window or priority" in e.value.details()
