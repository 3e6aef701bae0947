"""Bucketing: MICO's uniform buckets, quantile edges, representative values and expectations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.buckets import Buckets, make_buckets, quantile_buckets, uniform_buckets


def test_uniform_labels_follow_mico_formula():
    b = uniform_buckets([0, 1000], n=10, l_max=1000)
    lengths = np.array([0, 99, 100, 101, 550, 999, 1000, 5000])
    # label = floor(l / (l_max / N)), clipped into the last bucket
    expected = np.minimum(np.floor(lengths / 100), 9).astype(int)
    assert b.label(lengths).tolist() == expected.tolist()
    assert b.label([100]).tolist() == [1]  # exactly on an edge goes to the upper bucket
    assert b.midpoints.tolist() == [50 + 100 * i for i in range(10)]


def test_uniform_l_max_defaults_to_longest_training_answer():
    b = uniform_buckets([10, 20, 400], n=4)
    assert b.edges[-1] == 400 and b.n == 4
    assert b.label([400]).tolist() == [3]


def test_quantile_buckets_balance_and_values():
    lengths = np.arange(1, 1001)
    b = quantile_buckets(lengths, n=10)
    assert b.n == 10
    counts = np.bincount(b.label(lengths), minlength=b.n)
    assert counts.min() >= 95 and counts.max() <= 105
    # representative value = mean training length of the bucket
    lab = b.label(lengths)
    assert np.allclose(b.values, [lengths[lab == i].mean() for i in range(b.n)])


def test_quantile_ties_merge_buckets():
    b = quantile_buckets([5] * 50 + [6] * 50, n=10)
    assert 1 <= b.n <= 2
    assert all(y > x for x, y in zip(b.edges, b.edges[1:], strict=False))
    one = quantile_buckets([7, 7, 7], n=4)
    assert one.n == 1 and one.label([0, 7, 100]).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "call",
    [
        lambda: uniform_buckets([1, 2], n=0),
        lambda: uniform_buckets([], n=3),
        lambda: uniform_buckets([1], n=3, l_max=0),
        lambda: quantile_buckets([], n=3),
        lambda: quantile_buckets([1, -2, 3], n=2),
        lambda: make_buckets([1, 2], scheme="log"),
        lambda: Buckets((0.0, 5.0, 5.0), (1.0, 2.0)),
        lambda: Buckets((0.0, 5.0), (1.0, 2.0)),
    ],
)
def test_bad_bucket_input_is_rejected(call):
    with pytest.raises(ValueError):
        call()


def test_expectation_midpoint_and_calibration():
    b = uniform_buckets([10, 30, 50, 70], n=4, l_max=80)
    probs = np.array([[1, 0, 0, 0], [0, 0, 0.5, 0.5]])
    assert np.allclose(b.expected(probs), [10, 60])
    assert np.allclose(b.midpoint(probs.argmax(1)), [10, 50])
    assert np.allclose(b.with_calibration(2.0).expected(probs), [20, 120])
    with pytest.raises(ValueError):
        b.expected(np.ones((2, 3)) / 3)


def test_round_trip_through_dict(tmp_path):
    b = quantile_buckets(np.random.default_rng(0).integers(1, 500, 300), n=8).with_calibration(1.25)
    b.save(tmp_path / "b.json")
    assert Buckets.load(tmp_path / "b.json") == b


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 5000), min_size=1, max_size=200),
    st.integers(1, 20),
    st.sampled_from(["uniform", "quantile"]),
)
def test_labels_in_range_and_monotone(lengths, n, scheme):
    if scheme == "uniform" and max(lengths) == 0:
        return
    b = make_buckets(lengths, scheme, n)
    probe = np.sort(np.array(lengths + [0, 10_000]))
    lab = b.label(probe)
    assert lab.min() >= 0 and lab.max() < b.n
    assert np.all(np.diff(lab) >= 0)


def test_predictive_median_interpolates_within_buckets():
    # no within-bucket table: uniform between the edges
    b = Buckets((0.0, 10.0, 30.0, 100.0), (5.0, 20.0, 60.0))
    probs = np.array([[1.0, 0, 0], [0.25, 0.5, 0.25], [0.1, 0.2, 0.7], [0.5, 0.0, 0.5]])
    # row 2: the median lies half way through the middle bucket; row 3: 0.2 of the way into the last
    assert np.allclose(b.median(probs), [5.0, 20.0, 30.0 + 70.0 * 0.2 / 0.7, 10.0])
    assert np.allclose(b.quantile(probs[:1], 0.9), [9.0])
    with pytest.raises(ValueError):
        b.quantile(probs, 1.0)
    # with the training lengths' table: a bucket whose answers are all 20 tokens has its median at 20
    lengths = np.array([3] * 10 + [20] * 10 + [40, 50, 90] * 3)
    q = quantile_buckets(lengths, n=3)
    assert q.within is not None and len(q.within) == q.n
    one_hot = np.eye(q.n)
    assert np.allclose(q.median(one_hot), [np.median(lengths[q.label(lengths) == k]) for k in range(q.n)])
    # the median follows the probability mass monotonically
    mix = np.array([[1 - t, t, 0.0] for t in np.linspace(0, 1, 11)])
    assert np.all(np.diff(q.median(mix)) >= 0)


def test_within_table_survives_round_trip_and_calibration(tmp_path):
    b = quantile_buckets(np.random.default_rng(1).integers(1, 300, 200), n=6)
    c = b.with_calibration(1.5)
    assert c.within == b.within
    c.save(tmp_path / "b.json")
    assert Buckets.load(tmp_path / "b.json") == c
    old = Buckets.from_dict({k: v for k, v in c.to_dict().items() if k != "within"})
    assert old.within is None  # files written before the table existed still load


def test_wide_tail_buckets_are_split_log_spaced():
    lengths = np.concatenate([np.arange(1, 101).repeat(5), [150, 300, 600, 1200]])
    plain = quantile_buckets(lengths, n=4)
    split = quantile_buckets(lengths, n=4, max_ratio=1.5)
    assert split.n > plain.n
    e = np.asarray(split.edges)
    assert e[0] == 0 and np.all(np.diff(e) > 0) and e[-1] == plain.edges[-1]
    assert set(plain.edges) <= set(split.edges)  # the quantile edges stay
    ratios = e[2:] / e[1:-1]
    assert np.all(ratios <= 1.5 + 0.02)  # half-integer snapping may stretch a piece a little
    assert split.within is not None and len(split.within) == split.n
    with pytest.raises(ValueError):
        quantile_buckets(lengths, n=4, max_ratio=1.0)


def test_cdf_inverts_the_predictive_quantiles():
    lengths = np.random.default_rng(2).integers(1, 400, 500)
    b = quantile_buckets(lengths, n=8, max_ratio=1.5)
    probs = np.random.default_rng(3).dirichlet(np.ones(b.n), size=20)
    for q in (0.1, 0.5, 0.8):
        x = b.quantile(probs, q)
        assert np.allclose([b.cdf(probs[i : i + 1], x[i])[0] for i in range(len(x))], q, atol=1e-9)
    assert np.allclose(b.cdf(probs, 0.0), 0.0) and np.allclose(b.cdf(probs, b.edges[-1]), 1.0)
    # no within table: uniform between the edges
    plain = Buckets((0.0, 10.0, 30.0), (5.0, 20.0))
    assert np.allclose(plain.cdf(np.array([[0.5, 0.5]]), 20.0), [0.75])


def test_mass_in_another_bucketing():
    b = Buckets((0.0, 10.0, 30.0, 100.0), (5.0, 20.0, 60.0))
    probs = np.array([[0.2, 0.4, 0.4], [1.0, 0.0, 0.0]])
    m = b.mass_in(probs, (0.0, 20.0, 50.0))  # the last interval takes everything above 20
    assert np.allclose(m, [[0.2 + 0.2, 0.2 + 0.4], [1.0, 0.0]])
    assert np.allclose(b.mass_in(probs, b.edges), probs)  # its own edges give its own probabilities
    with pytest.raises(ValueError):
        b.mass_in(probs, (0.0, 20.0, 20.0))
    with pytest.raises(ValueError):
        b.mass_in(probs[:, :2], (0.0, 20.0))
