"""The cluster file: one versioned schema, refused with the bad field named, written and read back."""

from __future__ import annotations

import json

import pytest

from clusterfile import (
    ClusterFileError,
    Emulation,
    dump_cluster_file,
    load_cluster_file,
    parse_cluster_file,
)


def _refused(data: object) -> str:
    with pytest.raises(ClusterFileError) as e:
        parse_cluster_file(data, "f.yaml")
    return str(e.value)


def test_devices_and_capacities_both_describe_clusters_and_the_emulation_has_defaults():
    doc = parse_cluster_file(
        {"version": 1, "clusters": [{"name": "fast", "devices": ["A100-40G", "T4"]},
                                    {"name": "aws", "capacity_tps": 3082, "backend": "vllm", "plan": "p.json"}]}
    )  # fmt: skip
    assert [c.name for c in doc.clusters] == ["fast", "aws"]
    assert doc.clusters[0].devices == ["A100-40G", "T4"] and doc.clusters[1].capacity_tps == 3082
    assert doc.planned and doc.emulation == Emulation()


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"clusters": [{"name": "a"}]}, "version: missing: add `version: 1`"),
        ({"version": 2, "clusters": [{"name": "a"}]}, "version"),
        ({"version": 1, "clusters": []}, "clusters"),
        ({"version": 1, "clusters": [{"name": "a", "flavour": "x"}]}, "cluster 'a': flavour: unknown field"),
        ({"version": 1, "clusters": [{"name": "a", "capacity_tps": -1}]}, "cluster 'a': capacity_tps"),
        ({"version": 1, "clusters": [{"name": "a", "capacity_tps": True}]}, "cluster 'a': capacity_tps"),
        ({"version": 1, "clusters": [{"name": "a", "capacity_tps": float("inf")}]}, "capacity_tps"),
        ({"version": 1, "clusters": [{"name": "a b"}]}, "cluster 'a b': name: must be 1-128 characters"),
        ({"version": 1, "clusters": [{"capacity_tps": 1}]}, "cluster #1: name"),
        ({"version": 1, "clusters": [{"name": "a", "backend": "tgi"}]}, "cluster 'a': backend"),
        ({"version": 1, "clusters": [{"name": "a", "market": "auction"}]}, "cluster 'a': market"),
        ({"version": 1, "clusters": [{"name": "a", "devices": [""]}]}, "cluster 'a': devices"),
        ({"version": 1, "clusters": [{"name": "a"}, {"name": "a"}]}, "'a' appears twice"),
        ({"version": 1, "clusters": [{"name": "a"}], "emulation": {"time_scale": 0}}, "emulation.time_scale"),
        ({"version": 1, "clusters": [{"name": "a"}], "fleet": 1}, "fleet: unknown field"),
        (["a"], "expected a mapping"),
    ],
)
def test_a_bad_file_is_refused_naming_the_field(data, named):
    assert named in _refused(data)


def test_the_price_fields_are_validated_and_priced(tmp_path):
    doc = parse_cluster_file(
        {"version": 1, "clusters": [{"name": "spot", "price_per_hour": 1.2, "market": "spot",
                                     "served_model": "/models/m"},
                                    {"name": "plain"}]}
    )  # fmt: skip
    assert (
        doc.clusters[0].reserved_set() == [] and doc.clusters[0].hourly_price() == 1.2
    )  # its own: no discount
    assert doc.clusters[1].hourly_price() is None  # no price, no devices: not known
    assert "price_per_hour" in _refused({"version": 1, "clusters": [{"name": "a", "price_per_hour": -2}]})


def test_written_files_read_back_the_same_and_json_reads_too(tmp_path):
    path = tmp_path / "clusters.yaml"
    written = dump_cluster_file(path, [{"name": "c1", "capacity_tps": 50, "engine_args": ["--size", "nano"]}])
    assert path.read_text().startswith("version: 1\n")
    assert load_cluster_file(path) == written
    as_json = tmp_path / "clusters.json"
    as_json.write_text(json.dumps(written.model_dump()))
    assert load_cluster_file(as_json) == written


def test_missing_and_unreadable_files_are_named(tmp_path):
    with pytest.raises(ClusterFileError, match="not found"):
        load_cluster_file(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("clusters: [\n")
    with pytest.raises(ClusterFileError, match="not valid YAML"):
        load_cluster_file(bad)
