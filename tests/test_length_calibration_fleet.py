"""The length calibration end to end: a real engine serving a model whose answers run 3x the predictor's
estimates records them, and two gateway replicas on one Redis calibrate alike from what it recorded."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from gateway.assign.calibrated import REFRESH_S, LengthCalibrator
from gateway.cli import main as gateway_cli
from gateway.config import ClusterSpec, GatewayConfig
from gateway.offload.offloader import Offloader
from gateway.status.metrics import GatewayMetrics
from load.studies.warmup import Warmup
from load.workload import from_dataset
from planner.cli import expected_tokens_from_file
from predictor.baselines import prompt_length_heuristic
from predictor.calibration import Calibration
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, start_engine, wait_until
from workqueue import Observation, WorkQueue, connect, keys
from workqueue.length_stats import read_stats
from workqueue.script_call import execute

ENGINE_ARGS = ("--backend", "static", "--size", "nano", "--max-running", "8", "--length-model", "served-3x")


def prompts(n: int) -> list[str]:
    return [" ".join(["word"] * (1 + 3 * i)) for i in range(n)]


def raw_estimate(prompt: str) -> float:
    """The gateway's raw estimate with ``--predictor heuristic``."""
    return float(prompt_length_heuristic([len(prompt.split())])[0])


def submit(address: str, batch: list[str], forced: bool) -> str:
    queries = [
        pb.Query(
            id=f"q{i}",
            prompt=p,
            max_tokens=2048,
            forced_length=round(3 * raw_estimate(p)) if forced else None,
        )
        for i, p in enumerate(batch)
    ]
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.BatchServiceStub(ch).SubmitBatch(pb.SubmitBatchRequest(queries=queries)).id


def estimates(queue: WorkQueue, batch_id: str, n: int) -> list[tuple[float, float]]:
    """(raw, calibrated) estimate of each of the batch's rows, as its payload in Redis holds them."""
    out = []
    for i in range(n):
        p = json.loads(queue.r.hget(keys.query(keys.gid(batch_id, f"q{i}")), "payload"))
        out.append((p["raw_predicted_tokens"], p["predicted_tokens"]))
    return out


def test_two_replicas_calibrate_alike_from_what_the_engine_observed(redis_url, tmp_path):
    def config() -> GatewayConfig:
        return GatewayConfig(redis_url=redis_url, predictor_dir="heuristic", clusters=[ClusterSpec("c")])

    a, b = GatewayThread(config()), GatewayThread(config())
    addr_a, addr_b = a.start(), b.start()
    queue = WorkQueue(connect(redis_url))
    engine = start_engine("c", redis_url, tmp_path, *ENGINE_ARGS)
    try:
        wait_until(lambda: all(c.alive for c in queue.clusters(["c"])), 240, "the engine's heartbeat")
        # before any answer: no calibration, the estimates are the predictor's own
        first = submit(addr_a, prompts(24), forced=True)
        assert all(raw == cal for raw, cal in estimates(queue, first, 24))
        wait_until(lambda: queue.batch(first).status == "completed", 300, "the first batch")
        wait_until(lambda: read_stats(queue.r, "served-3x").count >= 24, 30, "the observed lengths")
        stats = read_stats(queue.r, "served-3x")
        assert stats.count == 24  # each answer once
        assert abs(sum(stats.observed) / sum(stats.raw) - 3.0) < 0.01
        # a replica keeps the calibration it read for REFRESH_S (its background loops read it too, maybe while
        # the first batch's answers were still coming in): from now on, what either reads holds all 24
        time.sleep(REFRESH_S)
        engine.terminate()
        engine.wait(timeout=30)
        # no engine answers the next batches (the statistics stay put): they wait on c while its heartbeat lasts,
        # then on a cluster whose engine has not started yet
        queue.register_cluster("later", capacity_hint_tps=100.0)
        # replica B never saw the first batch: it calibrates from what the engine recorded
        ask = prompts(24)[::3]
        second = submit(addr_b, ask, forced=False)
        ratios_b = [cal / raw for raw, cal in estimates(queue, second, len(ask))]
        third = submit(addr_a, ask, forced=False)
        ratios_a = [cal / raw for raw, cal in estimates(queue, third, len(ask))]
    finally:
        a.stop()
        b.stop()
        if engine.poll() is None:
            engine.kill()
            engine.wait(timeout=30)
    assert ratios_a == ratios_b  # one calibration, shared through Redis
    # 24 answers of 3x, shrunk toward 1 while they are few: moved most of the way, never past 3x
    assert all(1.8 < r <= 3.0 for r in ratios_b), ratios_b


def test_a_resent_observation_call_counts_once_and_the_metrics_show_the_calibration(redis_url):
    queue = WorkQueue(connect(redis_url))
    queue.register_cluster("once")
    queue.r.hset(keys.cluster_info("once"), "length_model", "m-once")  # as its worker registers it
    rows = [Observation(f"p{i}", 3 * (50 + i), predicted=50.0 + i, retrain=i % 2 == 0) for i in range(20)]
    listed = queue.r.llen(keys.OBSERVED)
    ops = queue.observed_commands(rows, call="call-1", length_model="m-once")
    for _ in range(2):  # the same call sent twice: its reply was lost
        execute(queue.r, ops)
    stats = read_stats(queue.r, "m-once")
    assert stats.count == 20 and sum(stats.observed) == 3 * sum(stats.raw)
    assert queue.r.llen(keys.OBSERVED) == listed + 10  # only the rows kept for retraining are listed
    metrics = GatewayMetrics()
    offloader = Offloader(queue, metrics=metrics, calibrator=LengthCalibrator(queue))
    offloader.tick()
    ratio = metrics.registry.get_sample_value("fleetbatch_length_calibration_ratio")
    assert ratio == pytest.approx(Calibration.from_stats(stats).ratio) and 1.5 < ratio < 3.0
    assert metrics.registry.get_sample_value("fleetbatch_length_calibration_observations") == 20


def test_gateway_calibrate_teaches_a_model_from_a_file_of_its_answers(redis_url, tmp_path, capsys):
    answers = tmp_path / "answers.jsonl"
    rows = [{"prompt": " ".join(["w"] * (i + 1)), "length": 2 * (65 + i)} for i in range(30)]
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["calibrate", "--redis-url", redis_url, "--predictor", "heuristic"]
    assert gateway_cli([*base, "--answers", str(answers)]) == 1  # no model registered yet: which one?
    assert "name one length model" in capsys.readouterr().err
    dist = tmp_path / "lengths.json"
    taught = [*base, "--length-model", "m2x", "--answers", str(answers), "--distribution", str(dist)]
    assert gateway_cli(taught) == 0
    shown = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["models"][0]
    assert shown["length_model"] == "m2x" and shown["observations"] == 30
    assert 1.5 < shown["ratio"] <= 2.0  # the heuristic's estimates are 64 + words: the answers run 2x them
    # the planner reads the observed lengths: their mean
    assert expected_tokens_from_file(str(dist)) == pytest.approx(
        sum(r["length"] for r in rows) / 30, rel=1e-3
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    assert gateway_cli([*base, "--length-model", "m2x", "--answers", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "line 1" in err and "length" in err


def test_a_warm_up_teaches_answers_to_prompts_outside_the_workload(redis_url, data_root):
    items = from_dataset("alpaca_eval:alpaca-7b", 780, seed=0, max_tokens=64, forced=True)
    warm = Warmup.of("alpaca_eval:alpaca-7b", items, 40, seed=0, max_tokens=64, predictor="heuristic")
    used = {it.prompt for it in items}
    assert 0 < len(warm.prompts) <= 40 and not used & set(warm.prompts)  # never a workload prompt
    assert all(1 <= n <= 64 for n in warm.lengths)  # capped as the workload's lengths are
    queue = WorkQueue(connect(redis_url))
    queue.register_cluster("w")
    queue.r.hset(keys.cluster_info("w"), "length_model", "m-warm")  # as its worker registers it
    taught = warm.teach(redis_url, clusters=1, timeout_s=5)
    assert taught["length_models"] == ["m-warm"] and taught["answers"] == len(warm.prompts)
    assert read_stats(queue.r, "m-warm").count == len(warm.prompts)
