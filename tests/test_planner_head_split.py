"""The LM head shared by the first and last pipeline stage (``planner.head_split``): the share
balances the two stages' decode micro-batches, the search scores plans with it, and the plan file
carries it to the engine."""

from __future__ import annotations

import json

import pytest

from planfile import PlanError, load_plan, plan_from_dict
from planner.cli import main
from planner.cluster import Cluster, cluster_from_dict
from planner.costs import Assignment, Workload
from planner.head_split import head_share
from planner.latency import Profile, roofline_profile
from planner.modelshape import load_shape
from planner.problem import build_problem, latency_models

SHAPE = load_shape("llama:small")  # hidden 512, vocabulary 8192: the head outweighs a layer
WORKLOAD = Workload(batch=16, prompt_len=64, output_tokens=32, bits=(16,))
EVEN = Assignment(order=(0, 1), stage_layers=(4, 4), bits=(16,) * 8, v_prefill=4, v_decode=8)


def _cluster(slowdowns: list[float]) -> Cluster:
    devices = [{"type": "CPU", "count": 1, "slowdown": s} for s in slowdowns]
    return cluster_from_dict({"name": "box", "nodes": [{"name": "box", "devices": devices}]})


def test_head_share_evens_out_the_two_stages():
    f = head_share(dec_first=4.0, dec_last=5.5, head_first=1.5, head_last=1.5)
    assert f == pytest.approx(0.5)
    assert 4.0 + f * 1.5 == pytest.approx(5.5 - f * 1.5)
    assert head_share(5.0, 4.0, 1.0, 1.0) == 0.0  # the first stage is already the slower one
    assert head_share(0.0, 10.0, 1.0, 1.0) == 1.0  # at most the whole head
    assert head_share(1.0, 2.0, 0.0, 0.0) == 0.0


def test_evaluation_balances_first_and_last_stage():
    plain = build_problem(_cluster([0.0, 0.0]), SHAPE, WORKLOAD).evaluate(EVEN)
    split = build_problem(_cluster([0.0, 0.0]), SHAPE, WORKLOAD, head_split=True).evaluate(EVEN)
    assert plain.head_split == 0.0
    assert plain.stage_decode_s[1] > plain.stage_decode_s[0]  # the head makes the last stage slower
    assert 0 < split.head_split < 1
    assert split.stage_decode_s[0] == pytest.approx(split.stage_decode_s[1], rel=1e-9)
    assert max(split.stage_decode_s) < max(plain.stage_decode_s)
    assert split.decode_s < plain.decode_s and split.objective < plain.objective
    assert split.stage_memory_bytes[0] > plain.stage_memory_bytes[0]  # the untied head's rows it holds
    assert split.stage_memory_bytes[1] == plain.stage_memory_bytes[1]  # the last stage is not credited


def test_a_slow_first_stage_takes_less_or_none_of_the_head():
    fast_first = build_problem(_cluster([0.0, 0.0]), SHAPE, WORKLOAD, head_split=True).evaluate(EVEN)
    slow_first = build_problem(_cluster([1.0, 0.0]), SHAPE, WORKLOAD, head_split=True).evaluate(EVEN)
    assert slow_first.head_split < fast_first.head_split
    three = Assignment(order=(1, 0), stage_layers=(2, 6), bits=(16,) * 8, v_prefill=4, v_decode=8)
    problem = build_problem(_cluster([0.0, 3.0]), SHAPE, WORKLOAD, head_split=True)
    e = problem.evaluate(three)  # 6 layers on the slow device first: already the bottleneck
    assert e.head_split == 0.0


def _plan(tmp_path, *flags: str) -> dict:
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        json.dumps({"name": "2xCPU", "nodes": [{"name": "n", "devices": [{"type": "CPU", "count": 2}]}]})
    )
    out = tmp_path / "plan.json"
    argv = ["plan", "--cluster-spec", str(cluster), "--shape", "llama:small", "--bits", "16", "--stages", "2"]
    argv += ["--tp-sizes", "1", "--prefill-chunks", "1", "--batch-size", "16", "--prompt-len", "64"]
    argv += ["--output-tokens", "32", "--time-limit", "2", "--out", str(out), *flags]
    assert main(argv) == 0
    load_plan(out)  # valid
    return json.loads(out.read_text())


def test_cli_writes_the_share_only_when_asked(tmp_path):
    plain = _plan(tmp_path)
    split = _plan(tmp_path, "--head-split")
    assert plain["head_split"] == 0.0
    assert 0 < split["head_split"] < 1
    dec = [s["predicted_decode_s"] for s in split["stages"]]
    assert dec[0] == pytest.approx(dec[1], rel=0.02)
    assert split["predicted_batch_latency_s"] < plain["predicted_batch_latency_s"]


def test_plan_file_checks_the_share(tmp_path):
    d = _plan(tmp_path, "--head-split")
    del d["head_split"]
    assert plan_from_dict(d).head_split == 0.0  # plans written before the field read as before
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(PlanError, match="head_split"):
            plan_from_dict({**d, "head_split": bad})
    one = {**d, "stages": [{**d["stages"][0], "layer_end": 8, "bits": [16] * 8}], "head_split": 0.3}
    with pytest.raises(PlanError, match="at least 2 stages"):
        plan_from_dict(one)


def _profile_with_driver(cluster: Cluster, driver_s: float | None) -> dict[str, Profile]:
    """The roofline's samples of the CPU, with a measured LM head and, unless None, the engine's
    own work per decode micro-batch (``fleetbatch engine profile``'s ``driver`` rows)."""
    dev = cluster.devices[0].type
    prof = roofline_profile(dev, SHAPE, (16,))
    head = [(v, 0.0, 1e-3 + 1e-4 * v) for v in (1, 8, 16)]
    samples = {16: {**prof.samples[16], "head": head}}
    if driver_s is not None:
        samples[16]["driver"] = [(v, 0.0, driver_s) for v in (1, 8, 16)]
    model = {
        "name": SHAPE.name,
        "hidden": SHAPE.hidden,
        "intermediate": SHAPE.intermediate,
        "vocab": SHAPE.vocab,
    }
    return {dev.name: Profile(dev.name, model, "measured", samples)}


def test_the_drivers_own_work_moves_head_rows_to_the_last_stage():
    cluster = _cluster([0.0, 0.0])
    shares = {}
    for driver in (None, 1e-12, 4e-4, 1e-2):
        problem = build_problem(
            cluster, SHAPE, WORKLOAD, profiles=_profile_with_driver(cluster, driver), head_split=True
        )
        e = problem.evaluate(EVEN)
        shares[driver] = e.head_split
        if (
            driver is not None and 0 < e.head_split
        ):  # balanced: compute + the driver's work on the first stage
            assert e.stage_decode_s[0] + driver == pytest.approx(e.stage_decode_s[1], rel=1e-6)
    assert shares[None] == pytest.approx(shares[1e-12]) and shares[None] > shares[4e-4] > 0
    assert shares[1e-2] == 0.0  # the driver's work alone outweighs the head: all of it stays last


def test_a_device_slowdown_does_not_scale_the_drivers_host_work():
    cluster = _cluster([1.0, 0.0])
    models = latency_models(cluster, SHAPE, (16,), _profile_with_driver(cluster, 5e-4))
    slow = models[cluster.devices[0].type.name]
    assert slow.driver_s(8) == pytest.approx(5e-4)
    assert slow.head_s(8) == pytest.approx(2 * (1e-3 + 8e-4))  # the head is the device's: scaled
