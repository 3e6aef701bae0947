"""The online length calibration (:mod:`predictor.calibration`): it learns a served model's lengths, shrinks
toward the identity while observations are few, never reorders estimates; and
``fleetbatch predictor eval --leave-one-model-out`` on a small synthetic alpaca_eval directory."""

from __future__ import annotations

import json

import numpy as np
import torch

from predictor.calibration import Calibration, calibration_of
from predictor.cli import main as predictor_main
from tests.predictor_fixtures import save_small_tokenizer, synthetic
from workqueue.length_stats import RANGE_EDGES, LengthStats, range_of

torch.set_num_threads(1)


def _stats(raw: np.ndarray, observed: np.ndarray) -> LengthStats:
    s = LengthStats()
    for r, o in zip(raw, observed, strict=True):
        s.add(float(r), float(o))
    return s


def _served(n: int, seed: int, factor: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    """Raw estimates spread over the ranges; the served model answers ``factor`` x as long, with noise."""
    rng = np.random.default_rng(seed)
    raw = np.exp(rng.uniform(np.log(10), np.log(1500), n))
    return raw, factor * raw * rng.lognormal(-0.18, 0.6, n)  # mean of the noise ~1


def test_converges_on_a_model_three_times_as_long():
    raw, obs = _served(4000, 0)
    cal = calibration_of(_stats(raw, obs))
    new_raw, new_obs = _served(4000, 1)
    pred = cal.apply(new_raw)
    assert abs(pred.sum() / new_obs.sum() - 1) < 0.05
    assert 2.8 < cal.ratio < 3.2 and "4000 observed" in cal.describe()
    ranges = np.array([range_of(r) for r in new_raw])
    for i in set(ranges.tolist()):
        m = ranges == i
        if m.sum() >= 100:
            assert abs(pred[m].sum() / new_obs[m].sum() - 1) < 0.15, i


def test_no_observations_is_the_identity_and_few_move_it_a_little():
    x = np.array([5.0, 40.0, 300.0, 3000.0])
    empty = Calibration.from_stats(LengthStats())
    assert empty.is_identity and np.array_equal(empty.apply(x), x) and "identity" in empty.describe()
    assert Calibration.identity().is_identity
    previous = 1.0
    for n in range(1, 6):
        cal = Calibration.from_stats(_stats(np.full(n, 100.0), np.full(n, 300.0)))  # observed ratio 3
        r = float(cal.apply([100.0])[0] / 100.0)
        assert previous < r < 3.0**0.5, (n, r)  # toward 3, less than half the way in log
        previous = r
    many = Calibration.from_stats(_stats(np.full(1000, 100.0), np.full(1000, 300.0)))
    assert abs(float(many.apply([100.0])[0]) / 300.0 - 1) < 0.02


def test_strictly_increasing_whatever_the_observations():
    rng = np.random.default_rng(2)
    x = np.sort(np.exp(rng.uniform(np.log(1), np.log(20000), 5000)))
    for seed in range(20):
        r = np.random.default_rng(seed)
        n = int(r.integers(1, 400))
        raw = np.exp(r.uniform(np.log(5), np.log(3000), n))
        obs = raw * np.exp(r.normal(0, 1.5, n)) * r.choice([0.2, 1, 5], n)  # wild, even decreasing ratios
        y = Calibration.from_stats(_stats(raw, obs)).apply(x)
        assert np.all(np.diff(y) > 0), seed
    # a decreasing served model (long raw estimates answered short) is still mapped increasingly
    raw = np.array([e * 0.9 for e in RANGE_EDGES] * 50)
    y = Calibration.from_stats(_stats(raw, 5000.0 / raw)).apply(x)
    assert np.all(np.diff(y) > 0)
    assert np.array_equal(Calibration.from_stats(_stats(raw, raw)).apply([0.0, -1.0]), [0.0, -1.0])


def _answers(prompts: list[str], lengths: np.ndarray) -> list[dict]:
    return [
        {"instruction": p, "output": " ".join(["word"] * int(n))}
        for p, n in zip(prompts, lengths, strict=True)
    ]


def test_leave_one_model_out_command_on_a_small_set(tmp_path, capsys):
    data = synthetic(600, seed=5)
    (tmp_path / "alpaca_eval").mkdir()
    ref = tmp_path / "alpaca_eval" / "llama-2-7b-chat-hf.json"  # the shipped model's training answers
    ref.write_text(json.dumps(_answers(data.prompts, data.lengths)))
    order = np.random.default_rng(0).permutation(len(data))  # another order: rows match by prompt text
    rows = _answers([data.prompts[i] for i in order], data.lengths[order] * 2)
    (tmp_path / "alpaca_eval" / "verbose-model.json").write_text(json.dumps(rows))
    tok = tmp_path / "tok"
    save_small_tokenizer(tok)
    argv = ["eval", "--leave-one-model-out", "--data-dir", str(tmp_path), "--served-model", str(tok)]
    argv += ["--lomo-seeds", "2", "--lomo-folds", "3", "--adapt-ks", "none", "--threads", "1"]
    assert predictor_main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert (
        r["models"] == ["verbose-model"]
        and r["ks"] == [0, 100, 400]
        and r["reference_model"] == "llama-2-7b-chat-hf"
    )
    for key in ("sum_ratio_by_model", "sum_ratio_by_model_k100", "sum_ratio_by_model_k0", "train_split_bias"):
        assert set(r[key]) == {"verbose-model"}, key
    assert len(r["sum_ratio_by_model_quintile"]["verbose-model"]) == 5
    assert r["sum_ratio_by_model"]["verbose-model"] > r["sum_ratio_by_model_k0"]["verbose-model"] * 1.3
    for k in ("0", "100", "400"):
        assert r["tau_by_model"][k] == r["raw_tau_by_model"][k]  # a strictly increasing map keeps the ranking
    assert r["adapt"] == {} and set(r["goals"]) == {"k400_sum", "k400_quintile", "k100_sum"}
    assert any("verbose-model" in line and "calibration" in line for line in out)
    bad = predictor_main([*argv, "--lomo-models", "llama-2-7b-chat-hf"])
    assert bad != 0 and "unseen" in capsys.readouterr().err
