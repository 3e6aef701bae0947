"""The measured LM head: profile samples, ``LatencyModel.head_coef`` / ``head_s``, ``Problem.head_s``
(measured where the profile timed it, roofline otherwise, slowdown applied once) and the
``fleetbatch planner profile --batches/--lengths`` grid."""

from __future__ import annotations

import json

import pytest

from planner.catalog import local_cpu
from planner.cli import main
from planner.cluster import Cluster, cluster_from_dict
from planner.costs import Workload
from planner.latency import Profile, fit_head, fit_profile, lm_head_s, roofline_profile
from planner.modelshape import load_shape
from planner.problem import build_problem

SHAPE = load_shape("llama:small")  # hidden 512, vocab 8192, 8 layers
WORKLOAD = Workload(batch=16, prompt_len=64, output_tokens=32, bits=(16,))
HEAD = [(1, 0, 0.9e-3), (2, 0, 1.0e-3), (4, 0, 1.2e-3), (8, 0, 1.6e-3)]  # about 0.8 ms + 0.1 ms per token


def _cluster(slowdowns: list[float]) -> Cluster:
    devices = [{"type": "CPU", "count": 1, "slowdown": s} for s in slowdowns]
    return cluster_from_dict({"name": "box", "nodes": [{"name": "box", "devices": devices}]})


def _profile(head: list | None = HEAD) -> Profile:
    """A stand-in for a measured profile of the base CPU: its roofline layers, plus ``head`` samples."""
    rf = roofline_profile(local_cpu(1), SHAPE, [16])
    if head is not None:
        rf.samples[16]["head"] = list(head)
    return Profile("CPU", rf.model, "measured", rf.samples)


def test_head_samples_fit_and_roundtrip(tmp_path):
    path = tmp_path / "p.json"
    _profile().save(path)
    prof = Profile.load(path)
    assert prof.samples[16]["head"] == [tuple(map(float, r)) for r in HEAD]
    lm = fit_profile(prof)
    assert lm.head_coef is not None and all(c >= 0 for c in lm.head_coef)
    heads = [lm.head_s(v) for v in (1, 2, 4, 8, 32)]
    assert all(h > 0 for h in heads) and heads == sorted(heads) and heads[0] < heads[-1]
    for v, _, t in HEAD:
        assert lm.head_s(v) == pytest.approx(t, rel=0.05)
    # scaled() scales the head with the layers; the head is used whatever bit widths are fitted
    assert lm.scaled(3.0).head_s(8) == pytest.approx(3 * lm.head_s(8))
    assert fit_head([]) is None and fit_head([(4, 0, 2e-3), (4, 0, 4e-3)]) == (3e-3, 0.0)


def test_profile_without_head_loads_and_falls_back_to_roofline(tmp_path):
    path = tmp_path / "old.json"
    d = _profile(head=None).to_dict()
    assert "head" not in d["samples"]["16"]
    path.write_text(json.dumps(d))
    prof = Profile.load(path)
    lm = fit_profile(prof)
    assert lm.head_coef is None and lm.head_s(8) is None and lm.scaled(2.0).head_coef is None
    problem = build_problem(_cluster([0.0, 1.0]), SHAPE, WORKLOAD, profiles={"CPU": prof})
    roof = lm_head_s(problem.cluster.devices[0].type, SHAPE, 8)
    assert problem.head_s(0, 8) == pytest.approx(roof)
    assert problem.head_s(1, 8) == pytest.approx(2 * roof)


def test_problem_uses_measured_head_and_slows_it_once():
    prof = _profile()
    lm = fit_profile(prof)
    problem = build_problem(_cluster([0.0, 1.0]), SHAPE, WORKLOAD, profiles={"CPU": prof})
    assert problem.latency["CPU@x2"].head_coef is not None
    for v in (1, 8, 32):
        assert problem.head_s(0, v) == pytest.approx(lm.head_s(v))
        assert problem.head_s(0, v) != pytest.approx(lm_head_s(problem.cluster.devices[0].type, SHAPE, v))
        assert problem.head_s(1, v) == pytest.approx(2 * problem.head_s(0, v), rel=1e-12)
    # the last stage's decode time holds the measured head
    cp, cd = problem.stage_constants((0, 1), 1, 4, 8)
    assert cd == pytest.approx(problem.comm_decode_s(0, 1, 8) + problem.head_s(1, 8))
    assert cp == pytest.approx(problem.comm_prefill_s(0, 1, 4) + problem.head_s(1, 4))


def test_head_kept_when_bits_come_from_the_roofline():
    wl = Workload(batch=16, prompt_len=64, output_tokens=32, bits=(4, 16))
    problem = build_problem(_cluster([0.0]), SHAPE, wl, profiles={"CPU": _profile()})
    lm = problem.latency["CPU"]
    assert lm.bits == (4, 16) and lm.head_coef == fit_profile(_profile()).head_coef


def test_head_for_another_vocabulary_is_not_used():
    prof = _profile()
    prof.model = {**prof.model, "vocab": 32000}
    problem = build_problem(_cluster([0.0]), SHAPE, WORKLOAD, profiles={"CPU": prof})
    assert problem.latency["CPU"].head_coef is None
    assert problem.head_s(0, 8) == pytest.approx(lm_head_s(problem.cluster.devices[0].type, SHAPE, 8))


def test_cli_profile_batches_and_lengths(tmp_path, capsys):
    out = tmp_path / "nano.json"
    argv = ["profile", "--shape", "llama:nano", "--batches", "2,4", "--lengths", "16,32"]
    argv += ["--reps", "1", "--min-time", "0.001", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    prof = Profile.load(out)
    ph = prof.samples[16]
    assert sorted((v, s) for v, s, _ in ph["prefill"]) == [(2, 16), (2, 32), (4, 16), (4, 32)]
    assert sorted((v, c) for v, c, _ in ph["decode"]) == [(2, 16), (2, 32), (4, 16), (4, 32)]
    assert [v for v, *_ in ph["head"]] == [2, 4] and all(t > 0 for *_, t in ph["head"])
    assert summary["head_points"] == 2 and len(summary["head_coef"]) == 2
    h0, h1 = fit_head(ph["head"])
    assert h0 >= 0 and h1 >= 0 and h0 + 4 * h1 > 0
    # a 2 x 2 grid is too small to fit the layer model: the profile is written all the same
    assert summary["prefill_coef"] is None and "warning" in captured.err


@pytest.mark.parametrize("bad", ["0,2", "x", ",", "-4"])
def test_cli_profile_rejects_bad_sizes(bad, capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--batches", bad, "--no-progress"])
    assert "grid sizes" in capsys.readouterr().err


def test_profile_grids_from_options():
    from planner.cli import build_parser
    from planner.cli_measure import _profile_grids
    from planner.profiler import DECODE_CONTEXTS, PREFILL_LENGTHS

    def grids(*opts: str):
        return _profile_grids(build_parser().parse_args(["profile", *opts]))

    assert grids() == (None, None)  # the profiler's default grid
    pre, dec = grids("--quick")
    assert pre == dec == [(v, s) for v in (1, 2, 4) for s in (64, 128, 256)]
    pre, dec = grids("--quick", "--batches", "32,8")  # explicit sizes override --quick's
    assert pre == [(v, s) for v in (8, 32) for s in (64, 128, 256)] and dec == pre
    pre, dec = grids("--lengths", "64")
    assert {s for _, s in pre} == {64} and {v for v, _ in dec} == {1, 2, 4, 8}
    pre, dec = grids("--batches", "16")
    assert pre == [(16, s) for s in PREFILL_LENGTHS] and dec == [(16, c) for c in DECODE_CONTEXTS]
