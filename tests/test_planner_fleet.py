"""`fleetbatch planner fleet`: a fleet of catalog devices mapped onto this CPU and planned cluster by cluster (issue 32).

The CPU profile here is synthetic (a layer that costs a fixed amount per call, per token and
per query), so the mapping's ratios and the plans are deterministic; `tests/test_demo.py` runs
the real one end to end.
"""

from __future__ import annotations

import json

import pytest

from planfile import load_plan
from planner.catalog import device_type
from planner.cli import main
from planner.cluster import ClusterSpecError
from planner.fleet import (
    DEFAULT_FLEET,
    Fleet,
    anchor,
    emulated_memory,
    fleet_clusters,
    fleet_from_dict,
    fleet_profiles,
    load_fleet,
)
from planner.fleet_plans import FleetJob, default_workload, plan_fleet
from planner.latency import Profile, roofline_decode_s
from planner.memory import MemoryModel
from planner.modelshape import load_shape

MODEL = "llama:micro"


def cpu_profile() -> Profile:
    """A profile of the served model as `fleetbatch engine profile` writes one, from a simple formula."""
    shape = load_shape(MODEL)
    prefill = [(v, s, 1e-4 + 2e-6 * v * s) for v in (1, 2, 4) for s in (64, 128, 256)]
    decode = [(v, c, 5e-4 + 2e-5 * v + 1e-8 * v * c) for v in (1, 8, 16, 32) for c in (64, 128, 256)]
    head = [(v, 0, 2e-4 + 1e-5 * v) for v in (1, 8, 16, 32)]
    driver = [(v, 0, 1e-4 + 1e-6 * v) for v in (1, 8, 16, 32)]
    model = {
        "name": MODEL,
        **{k: shape.essentials()[k] for k in ("hidden", "layers", "intermediate", "vocab")},
    }
    samples = {16: {"prefill": prefill, "decode": decode, "head": head, "driver": driver}}
    return Profile("CPU", model, "measured", samples)


def _one(cluster: dict) -> dict:
    return {"version": 1, "clusters": [cluster]}


def test_a_fleet_file_names_clusters_of_catalog_devices(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text(
        "version: 1\nclusters:\n  - {name: big, devices: [A100-40G, a100-40g]}\n"
        "  - {name: mixed, devices: [V100-32G, T4]}\nemulation: {time_scale: 4}\n"
    )
    fleet = load_fleet(f)
    assert fleet.clusters == {"big": ("A100-40G", "A100-40G"), "mixed": ("V100-32G", "T4")}
    assert fleet.time_scale == 4.0
    solo = {"version": 1, "clusters": [{"name": "solo", "devices": ["T4"]}]}
    assert (
        fleet_from_dict(solo).clusters == {"solo": ("T4",)} and fleet_from_dict(solo).reference == "opt-30b"
    )
    assert load_fleet("default").clusters == DEFAULT_FLEET
    assert fleet.digest() != load_fleet("default").digest()


@pytest.mark.parametrize(
    "spec, message",
    [
        ({}, "version"),
        ({"clusters": {"a": ["T4"]}}, "version"),  # the old fleet file's shape is refused, not misread
        (_one({"name": "a"}), "names each cluster's devices"),
        (_one({"name": "a", "devices": ["H9000"]}), "unknown device type 'H9000'"),
        (_one({"name": "a", "devices": ["CPU"]}), "a fleet names catalog GPUs"),
        (_one({"name": "a/b", "devices": ["T4"]}), "cluster 'a/b': name: must be 1-128 characters"),
        ({**_one({"name": "a", "devices": ["T4"]}), "emulation": {"time_scale": 0}}, "emulation.time_scale"),
        (
            {**_one({"name": "a", "devices": ["T4"]}), "emulation": {"reference": "gpt-9"}},
            "emulation.reference",
        ),
    ],
)
def test_a_bad_fleet_file_is_refused_with_the_reason(spec, message):
    with pytest.raises(ClusterSpecError, match=message):
        fleet_from_dict(spec)


def test_devices_keep_their_catalog_ratios_anchored_to_this_cpu():
    fleet = Fleet(dict(DEFAULT_FLEET), time_scale=5.0)
    ref = load_shape(fleet.reference)
    a100, t4 = device_type("A100-40G"), device_type("T4")
    assert anchor(fleet, ref) == a100
    profiles = fleet_profiles(fleet, cpu_profile(), load_shape(MODEL))
    cpu = cpu_profile().samples[16]["decode"]
    fast, slow = profiles["A100-40G"].samples, profiles["T4"].samples
    for (v, c, t), (_, _, ta), (_, _, tt) in zip(cpu, fast[16]["decode"], slow[16]["decode"], strict=True):
        assert ta == pytest.approx(5.0 * t)  # the anchor: time_scale x this CPU at 16 bits
        ratio = roofline_decode_s(t4, ref, 16, v, c) / roofline_decode_s(a100, ref, 16, v, c)
        assert tt / ta == pytest.approx(ratio)  # a T4 keeps its catalog ratio to an A100
        assert tt > 2 * ta
    # the reference is memory-bound in decode: 4-bit layers decode faster than 16-bit ones
    assert slow[4]["decode"][0][2] < slow[16]["decode"][0][2]
    assert fast[16]["driver"] == cpu_profile().samples[16]["driver"]  # host work is not scaled


def test_memory_budgets_keep_the_reference_models_shares():
    shape, ref = load_shape(MODEL), load_shape("opt-30b")
    w16 = shape.layers * MemoryModel(shape, 1, 1, 1).layer_weight_bytes(16)
    a100 = emulated_memory(device_type("A100-40G"), shape, ref)
    t4 = emulated_memory(device_type("T4"), shape, ref)
    assert 2 * a100 > w16 > 2 * t4  # two A100s hold the model at 16 bits, two T4s do not
    clusters = fleet_clusters(Fleet(dict(DEFAULT_FLEET)), shape)
    assert [d.type.memory_bytes for d in clusters["slow"].devices] == [t4, t4]
    assert all(d.type.emulated for c in clusters.values() for d in c.devices)


def test_every_cluster_is_planned_with_device_costs_and_cached(tmp_path):
    job = FleetJob(Fleet(dict(DEFAULT_FLEET)), load_shape(MODEL), cpu_profile(), default_workload(),
                   methods=("ilp", "uniform", "het"), time_limit_s=2.0)  # fmt: skip
    summary = plan_fleet(job, tmp_path)
    assert summary["cached"] is False and set(summary["clusters"]) == set(DEFAULT_FLEET)
    ilp = {name: rows["ilp"] for name, rows in summary["clusters"].items()}
    assert any(len(r["devices"]) >= 2 for r in ilp.values())  # a cluster runs pipeline stages
    assert any(len({b for st in r["bits"] for b in st}) > 1 for r in ilp.values())  # one mixes bits
    even = summary["clusters"]["slow"]["uniform"]
    assert all(b < 16 for st in even["bits"] for b in st)  # two T4s cannot hold it at 16 bits
    for rows in summary["clusters"].values():  # Uniform: an even split over all devices, one bit width
        counts = [hi - lo for lo, hi in rows["uniform"]["layers"]]
        assert max(counts) - min(counts) <= 1 and len({b for st in rows["uniform"]["bits"] for b in st}) == 1
    for rows in summary["clusters"].values():
        plan = load_plan(rows["ilp"]["plan"])  # a valid plan file
        for k, st in enumerate(plan.stages):
            cost = plan.device_cost(k)
            assert cost is not None and set(st.bits) <= set(cost.bits)
            weights_only = st.predicted_memory_bytes
            assert plan.devices[st.device_index]["memory_bytes"] > weights_only  # KV etc. granted on top
    again = plan_fleet(job, tmp_path)
    assert again["cached"] is True and again["clusters"] == summary["clusters"]
    other = FleetJob(Fleet({"solo": ("V100-32G",)}), job.shape, job.profile, job.workload, time_limit_s=2.0)
    assert plan_fleet(other, tmp_path)["cached"] is False  # another fleet: planned again


def test_the_cli_plans_a_fleet_file_and_names_bad_input(tmp_path, capsys):
    prof = tmp_path / "cpu.json"
    cpu_profile().save(prof)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("version: 1\nclusters: [{name: solo, devices: [T4, T4]}]\n")
    out = tmp_path / "plans"
    argv = ["fleet", str(fleet), "--profile", str(prof), "--out", str(out), "--time-limit", "1"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out / "solo.ilp.json").is_file() and summary["clusters"]["solo"]["ilp"]["plan"].endswith(
        "solo.ilp.json"
    )
    assert main(["fleet", str(tmp_path / "none.yaml"), "--profile", str(prof)]) == 1
    assert "cluster file" in capsys.readouterr().err
    assert main([*argv, "--methods", "best"]) == 1
    assert "--methods" in capsys.readouterr().err
    assert main(["fleet", str(fleet), "--profile", str(prof), "--shape", "llama:tiny"]) == 1
    assert "profile the served model" in capsys.readouterr().err
