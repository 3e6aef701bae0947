"""`fleetbatch loadgen submit`: results stream into --out as they come, --resume goes on from them, and a
gateway restart mid-stream loses and duplicates nothing. Real gateway, real Redis."""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from gateway.config import ClusterSpec, GatewayConfig
from load.cli import main
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, wait_until
from workqueue import WorkQueue, connect


def _gateway(redis_url: str, listen: str | None = None) -> tuple[GatewayThread, str]:
    g = GatewayThread(
        GatewayConfig(redis_url=redis_url, policy="round_robin", offload=False, clusters=[ClusterSpec("a")])
    )
    if listen:
        g.config.listen = listen
    return g, g.start()


def _finish(queue: WorkQueue, n: int) -> None:
    """An engine's work, done by hand: finish the next ``n`` queued queries of cluster a."""
    for claimed in queue.claim("a", n, "w", 30):
        q = claimed.query
        queue.complete(q.gid, {"batch_id": q.batch_id, "query_id": q.query_id, "text": "ok"}, "completed", 1)


def _lines(path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_resume_streams_on_from_the_results_in_out(redis_url, tmp_path, capsys):
    g, address = _gateway(redis_url)
    queue = WorkQueue(connect(redis_url))
    out = tmp_path / "out.jsonl"
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.BatchServiceStub(ch)
            req = pb.SubmitBatchRequest(batch_id="rb")
            for i in range(5):
                req.queries.add(id=f"q{i}", prompt=f"topic {i}", max_tokens=4)
            stub.SubmitBatch(req)
            _finish(queue, 2)
            seen = list(stub.StreamResults(pb.StreamResultsRequest(batch_id="rb")))
        # what a killed `fleetbatch loadgen submit --out` left: two rows, then a torn third one
        rows = [json.dumps({"query_id": r.query_id, "index": r.index, "text": r.text}) for r in seen]
        out.write_text("\n".join(rows) + '\n{"query_id": "q')
        code: list[int] = []
        t = threading.Thread(
            target=lambda: code.append(
                main(["submit", "--target", address, "--resume", "rb", "--out", str(out), "--no-progress"])
            )
        )
        t.start()
        wait_until(lambda: "batch rb" in capsys.readouterr().err, 30, "the batch id on stderr")
        _finish(queue, 3)
        t.join(timeout=60)
        assert code == [0]
    finally:
        g.stop()
    got = _lines(out)
    assert sorted(r["query_id"] for r in got) == [f"q{i}" for i in range(5)]
    assert [int(r["index"]) for r in got] == list(range(5))
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["results"], summary["duplicates"], summary["queries"]) == (5, 0, 5)


def test_resume_needs_out(redis_url):
    assert main(["submit", "--target", "127.0.0.1:1", "--resume", "rb", "--no-progress"]) == 1


def test_a_gateway_restart_mid_stream_loses_and_duplicates_nothing(redis_url, tmp_path, capsys):
    first, address = _gateway(redis_url)
    queue = WorkQueue(connect(redis_url))
    out = tmp_path / "out.jsonl"
    code: list[int] = []
    argv = ["submit", "--target", address, "--batch-id", "rs", "-n", "6", "--out", str(out), "--no-progress"]
    t = threading.Thread(target=lambda: code.append(main(argv)))
    t.start()
    second = None
    try:
        wait_until(lambda: queue.batch("rs") is not None, 30, "the batch")
        assert "batch rs (6 queries)" in capsys.readouterr().err
        _finish(queue, 3)
        wait_until(lambda: len(_lines(out)) == 3, 30, "three rows in --out")
        first.stop()
        _finish(queue, 1)  # finished while no gateway runs
        second, _ = _gateway(redis_url, listen=address)
        _finish(queue, 2)
        t.join(timeout=90)
        assert code == [0]
    finally:
        first.stop()
        if second is not None:
            second.stop()
    got = _lines(out)
    assert len(got) == 6 and len({r["query_id"] for r in got}) == 6


@pytest.mark.parametrize("mode", ["fail-row"])
def test_submit_on_bad_query_fail_row(redis_url, tmp_path, mode):
    """A bad row fails alone: here, a prompt over the gateway's byte limit."""
    g = GatewayThread(
        GatewayConfig(
            redis_url=redis_url,
            policy="round_robin",
            offload=False,
            max_prompt_bytes=64,
            clusters=[ClusterSpec("a")],
        )
    )
    address = g.start()
    queue = WorkQueue(connect(redis_url))
    jsonl = tmp_path / "in.jsonl"
    body = [{"prompt": "short one"}, {"prompt": "x" * 100}, {"prompt": "short two"}]
    jsonl.write_text(
        "".join(json.dumps({"custom_id": f"r{i}", "body": b}) + "\n" for i, b in enumerate(body))
    )
    out = tmp_path / "out.jsonl"
    code: list[int] = []
    argv = ["submit", "--target", address, "--jsonl", str(jsonl), "--out", str(out), "--no-progress"]
    t = threading.Thread(target=lambda: code.append(main([*argv, "--on-bad-query", mode])))
    try:
        t.start()
        wait_until(lambda: queue.clusters(["a"])[0].queue_length == 2, 30, "two good rows queued")
        _finish(queue, 2)
        t.join(timeout=60)
    finally:
        g.stop()
    got = {r["query_id"]: r for r in _lines(out)}
    assert set(got) == {"r0", "r1", "r2"}
    assert got["r1"]["finish_reason"] == "error" and "max_prompt_bytes" in got["r1"]["error"]
    assert got["r0"]["finish_reason"] != "error"
    assert code == [0]
