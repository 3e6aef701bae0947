"""Noisy copies of training prompts (``predictor.augment``)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.augment import augment, perturb
from predictor.labeled import LabeledSet


@given(
    st.lists(st.text(alphabet="abcdefgh", min_size=1, max_size=6), min_size=1, max_size=60),
    st.integers(0, 99),
)
@settings(max_examples=200, deadline=None)
def test_a_copy_keeps_its_words_in_order_and_loses_some(words, seed):
    prompt = " ".join(words)
    out = perturb(prompt, np.random.default_rng(seed)).split()
    it = iter(words)
    assert all(w in it for w in out)  # a subsequence: words only dropped, never moved or made up
    assert out  # never empty
    if len(words) >= 4:
        assert len(out) < len(words)  # the cut span always removes at least one word


def test_copies_carry_their_originals_labels():
    data = LabeledSet(
        [f"write {n} words about topic {n} in a friendly tone please" for n in range(20)] + ["hi"],
        np.arange(21) * 10,
        ["a"] * 10 + ["b"] * 11,
    )
    out = augment(data, 3, seed=1)
    assert 60 <= len(out) <= 63 and len(out) == len(out.lengths) == len(out.sources)
    for p, n, s in zip(out.prompts, out.lengths, out.sources, strict=True):
        i = int(n) // 10
        assert p != data.prompts[i] and s == data.sources[i]
        assert set(p.split()) <= set(data.prompts[i].split())  # a copy of the prompt its label came from
    assert augment(data, 3, seed=1).prompts == out.prompts  # seeded
    assert len(augment(data, 0)) == 0
    with pytest.raises(ValueError, match="--augment"):
        augment(data, -1)
