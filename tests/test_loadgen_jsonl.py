"""`fleetbatch loadgen submit --jsonl FILE` sends the whole file (it once sent its first 200 rows and said 200/200), read row
by row and sent in parts; `-n` is a cap that names the rows it leaves out; a bad line ends the submission with
its line number and creates nothing. Real gateway, real Redis; the engine's work done through the queue API."""

from __future__ import annotations

import json
import threading

from gateway.config import ClusterSpec, GatewayConfig
from load.cli import main
from tests.harness import GatewayThread, wait_until
from workqueue import WorkQueue, connect


def _file(path, n: int, bad_line: int | None = None) -> None:
    with open(path, "w") as f:
        for i in range(n):
            if i + 1 == bad_line:
                f.write("{not json\n")
                continue
            body = {"messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": 4}
            f.write(json.dumps({"custom_id": f"r{i}", "url": "/v1/chat/completions", "body": body}) + "\n")


def _drain(queue: WorkQueue, stop: threading.Event) -> None:
    while not stop.is_set():
        for c in queue.claim("a", 200, "w", 30):
            q = c.query
            queue.complete(
                q.gid, {"batch_id": q.batch_id, "query_id": q.query_id, "text": "ok"}, "completed", 1
            )
        stop.wait(0.05)


def _run(redis_url, argv: list[str], check=lambda: None) -> int:
    """``fleetbatch loadgen submit`` against a gateway with a drainer; ``check()`` runs before the gateway stops."""
    g = GatewayThread(GatewayConfig(redis_url=redis_url, offload=False, clusters=[ClusterSpec("a")]))
    address = g.start()
    stop = threading.Event()
    drainer = threading.Thread(target=_drain, args=(WorkQueue(connect(redis_url)), stop), daemon=True)
    drainer.start()
    try:
        code = main(["submit", "--target", address, "--no-progress", *argv])
        check()
        return code
    finally:
        stop.set()
        drainer.join(timeout=10)
        g.stop()


def test_the_whole_file_is_sent_in_parts_and_every_row_comes_back_once(redis_url, tmp_path, capsys):
    src, out, oai = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "batch_output.jsonl"
    _file(src, 450)
    argv = [
        "--jsonl",
        str(src),
        "--chat-template",
        "default",
        "--part-rows",
        "100",
        "--out",
        str(out),
        "--openai-out",
        str(oai),
    ]
    assert _run(redis_url, argv) == 0
    printed = capsys.readouterr()
    summary = json.loads(printed.out.strip().splitlines()[-1])
    assert (
        summary["queries"] == summary["results"] == summary["completed"] == 450 and summary["duplicates"] == 0
    )
    ids = [json.loads(line)["query_id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(450))
    assert len(oai.read_text().splitlines()) == 450


def test_num_is_a_cap_that_names_the_rows_it_leaves_out(redis_url, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    _file(src, 300)
    # chat rows with neither the served model nor the default template asked for by name: refused, nothing sent
    assert main(["submit", "--target", "127.0.0.1:1", "--no-progress", "--jsonl", str(src)]) == 1
    assert "a chat row needs the served model's chat template" in capsys.readouterr().err
    assert _run(redis_url, ["--jsonl", str(src), "--chat-template", "default", "-n", "120"]) == 0
    printed = capsys.readouterr()
    assert "sends the first 120 rows" in printed.err and "180 rows are left out" in printed.err
    assert json.loads(printed.out.strip().splitlines()[-1])["results"] == 120


def test_a_bad_line_ends_the_submission_with_its_number_and_creates_nothing(
    redis_url, tmp_path, capsys, caplog
):
    src = tmp_path / "in.jsonl"
    _file(src, 500, bad_line=430)
    queue = WorkQueue(connect(redis_url))

    def dropped() -> None:  # by the gateway that staged them, once it sees the call end
        wait_until(
            lambda: not [k for k in queue.r.scan_iter("*") if "staging" in k], 30, "the staged parts dropped"
        )

    assert (
        _run(redis_url, ["--jsonl", str(src), "--chat-template", "default", "--part-rows", "100"], dropped)
        == 1
    )
    assert "in.jsonl:430: not valid JSON" in capsys.readouterr().err
    assert not [r for r in caplog.records if r.name.startswith("grpc")]  # no traceback of gRPC's before it
    assert queue.batch_ids() == []


def test_file_soak_prints_one_json_object_with_the_clients_peak_memory(capsys):
    """`fleetbatch loadgen file-soak` (a million rows in docs/BENCHMARKS.md; a few thousand here): the client is a real
    `fleetbatch loadgen submit --jsonl` process against `fleetbatch gateway serve` on an embedded Redis."""
    assert main(["file-soak", "-n", "3000"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] is True and out["rows"] == out["results"] == 3000
    assert out["lost"] == out["duplicated"] == out["unknown_ids"] == 0 and out["client_exit"] == 0
    assert 20 < out["client_peak_rss_mb"] < 500 and out["file_mb"] > 0


def test_a_row_never_enqueued_does_not_move_the_first_enqueue():
    """Rows failed at intake carry enqueued_at 0: the per-cluster 'done after' counts from the first real one."""
    from load.client import Tally
    from protos import fleetbatch_pb2 as pb

    tally = Tally()
    for qid, enq, fin in (("a", 100.0, 130.0), ("b", 0.0, 0.0), ("c", 150.0, 160.0)):
        tally.add({"query_id": qid, "cluster": "x", "timings": {"enqueued_at": enq, "finished_at": fin}})
    summary = tally.summary(pb.Batch(id="b1"), 10.0)
    assert summary["clusters"]["x"]["finished_after_s"] == 60.0 and summary["results"] == 3
