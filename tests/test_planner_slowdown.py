"""Emulated unlike devices on one machine: a per-device ``slowdown`` in the cluster spec, scaled
latency models, uneven layer splits and the ``slowdown`` field of plan.json."""

from __future__ import annotations

import json

import pytest
import yaml

from planfile import PlanError, load_plan, plan_from_dict, save_plan
from planner.build import make_plan
from planner.catalog import local_cpu, with_slowdown
from planner.cli import main
from planner.cluster import Cluster, ClusterSpecError, cluster_from_dict, load_cluster
from planner.costs import Workload
from planner.ilp import solve_order
from planner.latency import Profile, roofline_profile
from planner.modelshape import load_shape
from planner.problem import build_problem
from planner.search import plan

SHAPE = load_shape("llama:small")  # 8 layers
WORKLOAD = Workload(batch=16, prompt_len=64, output_tokens=32, bits=(16,))


def _cluster(slowdowns: list[float], memory_gib: float | None = None) -> Cluster:
    mem = {} if memory_gib is None else {"memory_gib": memory_gib}
    devices = [{"type": "CPU", "count": 1, "slowdown": s, **mem} for s in slowdowns]
    return cluster_from_dict({"name": "box", "nodes": [{"name": "box", "devices": devices}]})


def _profile(scale: float = 1.0, device: str = "CPU") -> Profile:
    """A stand-in for a measured profile of the base CPU (its roofline, ``scale`` times as long)."""
    rf = roofline_profile(local_cpu(1), SHAPE, [16])
    samples = {
        b: {ph: [(v, s, t * scale) for v, s, t in rows] for ph, rows in phs.items()}
        for b, phs in rf.samples.items()
    }
    return Profile(device, rf.model, "measured", samples)


def test_with_slowdown_names_and_errors():
    cpu = local_cpu(1)
    assert with_slowdown(cpu, 0) is cpu
    slow = with_slowdown(cpu, 1.0)
    assert (slow.name, slow.base_name, slow.slowdown, slow.speed_factor) == ("CPU@x2", "CPU", 1.0, 2.0)
    assert with_slowdown(cpu, 0.5).name == "CPU@x1.5"
    assert with_slowdown(slow, 1.0).name == "CPU@x4" and with_slowdown(slow, 1.0).base_name == "CPU"
    assert cpu.base_name == "CPU" and cpu.slowdown == 0.0
    for bad in (-0.1, float("nan"), "x", None, True):
        with pytest.raises(ValueError, match="slowdown"):
            with_slowdown(cpu, bad)


def test_spec_with_slowdown_parses(tmp_path):
    spec = tmp_path / "box.yaml"
    spec.write_text(
        "name: box\nnodes:\n  - name: box\n    devices:\n"
        "      - {type: CPU, count: 1}\n"
        "      - {type: CPU, count: 1, slowdown: 1.0, memory_gib: 2}\n"
    )
    c = load_cluster(spec)
    fast, slow = (d.type for d in c.devices)
    assert fast.name != slow.name and fast.base_name == slow.base_name == "CPU"
    assert (fast.slowdown, slow.slowdown) == (0.0, 1.0)
    assert slow.memory_bytes == 2 * 1024**3
    assert "CPU@x2" in c.describe()


@pytest.mark.parametrize("bad", [-1.0, "fast", None, [1], True])
def test_bad_slowdown_is_a_spec_error(bad):
    spec = {"nodes": [{"name": "gpubox", "devices": [{"type": "CPU", "slowdown": bad}]}]}
    with pytest.raises(ClusterSpecError, match="gpubox.*slowdown"):
        cluster_from_dict(spec)


def test_latency_models_are_scaled():
    c = _cluster([0.0, 1.0])
    measured = build_problem(c, SHAPE, WORKLOAD, profiles={"CPU": _profile()})
    fast, slow = measured.latency["CPU"], measured.latency["CPU@x2"]
    assert slow.device == "CPU@x2"
    assert slow.prefill_s(16, 4, 64) == pytest.approx(2 * fast.prefill_s(16, 4, 64))
    assert slow.decode_s(16, 8, 96) == pytest.approx(2 * fast.decode_s(16, 8, 96))
    assert measured.head_s(1, 8) == pytest.approx(2 * measured.head_s(0, 8))
    # the roofline fallback is scaled the same way
    rl = build_problem(c, SHAPE, WORKLOAD)
    assert rl.latency["CPU@x2"].decode_s(16, 8, 96) == pytest.approx(
        2 * rl.latency["CPU"].decode_s(16, 8, 96)
    )
    # a profile under the exact name wins over the base name's, and is scaled too
    exact = build_problem(c, SHAPE, WORKLOAD, profiles={"CPU": _profile(), "CPU@x2": _profile(3.0)})
    assert exact.latency["CPU@x2"].decode_s(16, 8, 96) == pytest.approx(
        6 * fast.decode_s(16, 8, 96), rel=1e-6
    )


@pytest.mark.parametrize("slowdowns", [[0.0, 1.0], [1.0, 0.0]])
def test_slow_device_gets_fewer_layers(tmp_path, slowdowns):
    c = _cluster(slowdowns)
    problem = build_problem(c, SHAPE, WORKLOAD, profiles={"CPU": _profile()})
    r = plan(problem, "ilp", time_limit_s=3)
    assert r is not None
    layers = {
        c.devices[problem.unit_devices(u)[0]].type.slowdown: n
        for u, n in zip(r.assignment.order, r.assignment.stage_layers, strict=True)
    }
    assert set(layers) == {0.0, 1.0} and layers[1.0] < layers[0.0]

    pl = make_plan(problem, r.assignment, r.evaluation, "ilp", r.solve_seconds)
    path = tmp_path / "plan.json"
    save_plan(pl, path)
    q = load_plan(path)
    assert q.to_dict() == pl.to_dict()
    by_type = {d["type"]: d["slowdown"] for d in json.loads(path.read_text())["devices"]}
    assert by_type == {"CPU": 0.0, "CPU@x2": 1.0}
    for st in q.stages:
        n = st.layer_end - st.layer_start
        assert (n < 4) == (q.devices[st.device_index]["slowdown"] > 0)


def test_either_stage_order_gives_the_slow_device_fewer_layers():
    c = _cluster([0.0, 1.0])
    problem = build_problem(c, SHAPE, WORKLOAD, profiles={"CPU": _profile()})
    for order in ((0, 1), (1, 0)):
        a = solve_order(problem, order, 1, 8).assignment
        layers = dict(zip(order, a.stage_layers, strict=True))
        assert layers[1] < layers[0], (order, a.stage_layers)
    # without the slowdown the two CPUs share the layers evenly
    even = build_problem(_cluster([0.0, 0.0]), SHAPE, WORKLOAD, profiles={"CPU": _profile()})
    assert solve_order(even, (0, 1), 1, 8).assignment.stage_layers == (4, 4)


def test_plan_file_slowdown_validation():
    problem = build_problem(_cluster([0.0, 1.0]), SHAPE, WORKLOAD, profiles={"CPU": _profile()})
    r = plan(problem, "ilp", time_limit_s=3)
    d = make_plan(problem, r.assignment, r.evaluation, "ilp", r.solve_seconds).to_dict()
    for dev in d["devices"]:
        dev.pop("slowdown")  # plans written before the field still load
    assert all("slowdown" not in dev for dev in plan_from_dict(d).devices)
    for bad in (-0.5, "2", None, True, float("inf")):
        d["devices"][0]["slowdown"] = bad
        with pytest.raises(PlanError, match="slowdown"):
            plan_from_dict(d)


def test_cli_plan_with_slowdown_spec(tmp_path, capsys):
    spec = tmp_path / "box.yaml"
    devices = [{"type": "CPU", "count": 1}, {"type": "CPU", "count": 1, "slowdown": 1.0, "memory_gib": 2}]
    spec.write_text(yaml.safe_dump({"name": "box", "nodes": [{"name": "box", "devices": devices}]}))
    prof = tmp_path / "profile.json"
    _profile().save(prof)
    out = tmp_path / "plan.json"
    argv = ["plan", "--cluster-spec", str(spec), "--shape", "llama:small", "--profile", f"CPU={prof}"]
    argv += [
        "--bits",
        "16",
        "--batch-size",
        "16",
        "--prompt-len",
        "64",
        "--output-tokens",
        "32",
        "--out",
        str(out),
    ]
    argv += ["--time-limit", "3"]
    assert main(argv) == 0
    assert "CPU@x2" in capsys.readouterr().out
    q = load_plan(out)
    slow = {d["type"]: d["slowdown"] for d in q.devices}
    assert slow == {"CPU": 0.0, "CPU@x2": 1.0}
    n = {q.devices[s.device_index]["type"]: s.layer_end - s.layer_start for s in q.stages}
    assert n["CPU@x2"] < n["CPU"]
