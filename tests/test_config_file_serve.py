"""`gateway serve` and `engine serve` read their options from `--config-file` and FLEETBATCH_<OPTION>
variables: real processes, a real Redis."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import yaml

from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import REPO, serving_address, wait_until
from workqueue import WorkQueue, connect


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_engine_serve_takes_its_options_from_the_file_and_the_environment_over_it(tmp_path, redis_url):
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(
        yaml.safe_dump({"cluster": "from-file", "redis_url": redis_url, "size": "nano", "threads": 1})
    )
    env = dict(os.environ, FLEETBATCH_CLUSTER="from-env", PYTHONUNBUFFERED="1")
    log = open(tmp_path / "engine.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "engines.cli", "serve", "--config-file", str(cfg)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        queue = WorkQueue(connect(redis_url))
        wait_until(lambda: "from-env" in queue.cluster_names() or proc.poll() is not None, 120, "a heartbeat")
        assert proc.poll() is None, (tmp_path / "engine.log").read_text()
        assert "from-file" not in queue.cluster_names()  # the variable is over the file
    finally:
        _stop(proc)
        log.close()


def test_gateway_serve_runs_from_a_config_file_and_refuses_a_misspelt_key(tmp_path, redis_url):
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text("version: 1\nclusters:\n  - {name: east, capacity_tps: 100}\n")
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({"listen": "127.0.0.1:0", "redis_url": redis_url, "no_auth": True,
                                   "clusters": str(clusters), "policy": "token"}))  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config-file", str(cfg)],
        cwd=REPO, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        address = serving_address(proc)
        with grpc.insecure_channel(address) as ch:  # no_auth: true came from the file
            listed = pb_grpc.BatchServiceStub(ch).ListClusters(pb.ListClustersRequest(), timeout=10)
        assert [c.name for c in listed.clusters] == ["east"]
    finally:
        _stop(proc)
    cfg.write_text("listen: 127.0.0.1:0\nredis_ur1: redis://x\n")
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config-file", str(cfg)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1 and "redis_ur1: unknown option" in out.stderr, out.stderr
