"""Labelled data: deterministic splits, generic JSONL, the mixed workload from the shared data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fleetdata.datasets import MIXED_SOURCES, load_jsonl
from predictor.labeled import LabeledSet, label, records_for, split, split_of
from tests.predictor_fixtures import save_small_tokenizer


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    return save_small_tokenizer(tmp_path_factory.mktemp("tok"))


def _set(n: int) -> LabeledSet:
    return LabeledSet([f"prompt number {i}" for i in range(n)], np.arange(n), ["s"] * n)


def test_split_is_deterministic_disjoint_and_order_free():
    data = _set(2000)
    a = split(data)
    b = split(data.subset(np.arange(len(data))[::-1]))
    for name in ("train", "val", "test"):
        assert sorted(a[name].prompts) == sorted(b[name].prompts)
    sets = [set(a[n].prompts) for n in ("train", "val", "test")]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert sum(len(s) for s in sets) == 2000
    assert 0.75 < len(a["train"]) / 2000 < 0.85
    # the same prompt always gets the same split
    assert split_of("prompt number 7") == split_of("prompt number 7")


def test_bad_split_fractions():
    with pytest.raises(ValueError):
        split(_set(10), (0.9, 0.2))


def test_sample_is_deterministic_subset():
    data = _set(100)
    s1, s2 = data.sample(10, seed=3), data.sample(10, seed=3)
    assert s1.prompts == s2.prompts and len(s1) == 10
    assert set(s1.prompts) <= set(data.prompts)
    assert data.sample(None) is data


def test_jsonl_response_or_length(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(
        json.dumps({"prompt": "a b", "response": "one two three"})
        + "\n\n"
        + json.dumps({"prompt": "c", "length": 42, "source": "x"})
        + "\n"
    )
    recs = load_jsonl(p)
    assert [r.words() for r in recs] == [3, 42] and recs[1].source == "x"
    assert records_for(str(p)) == recs
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(ValueError, match="needs 'response' or 'length'"):
        load_jsonl(bad)
    with pytest.raises(FileNotFoundError):
        records_for(str(tmp_path / "missing.jsonl"))


def test_mixed_workload_sources_and_token_lengths(data_root, small_tokenizer):
    recs = records_for("mixed", data_root)
    assert {r.source for r in recs} == set(MIXED_SOURCES)
    sample = [recs[i] for i in range(0, len(recs), 200)]
    data = label(sample, small_tokenizer)
    assert (data.lengths >= 0).all() and data.lengths.max() > 50
    by = {s: np.median(data.lengths[np.array(data.sources) == s]) for s in set(data.sources)}
    # tool calls answer far more briefly than role-play
    assert by["toolformer"] < by["roleplay"]
    with pytest.raises(ValueError, match="unknown dataset"):
        records_for("no_such_set", data_root)
