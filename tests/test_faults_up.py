"""`fleetbatch gateway up` under faults: a killed engine is restarted, and a killed `fleetbatch gateway up` leaves no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, wait_until
from workqueue import WorkQueue, connect

pytestmark = pytest.mark.fault


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan reparented to a pid 1 that does not reap stays a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def read_info(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "gateway.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def check_secrets(run_dir: Path, info: dict) -> None:
    """Issue 31 (finding 7, 10): gateway.json and the token files are the owner's alone, no engine has
    the Redis URL on its command line, and the batch API wants the client token fleetbatch gateway up wrote."""
    import grpc

    from gateway.grpc_api.auth import deployment_token
    from gateway.grpc_api.tls import channel
    from protos import fleetbatch_pb2 as pb
    from protos import fleetbatch_pb2_grpc as pb_grpc

    assert (run_dir / "gateway.json").stat().st_mode & 0o077 == 0, (
        "gateway.json (the Redis URL) is readable by others"
    )
    for f in (Path(info["client_token_file"]), Path(info["admin_token_file"])):
        assert f.stat().st_mode & 0o077 == 0, f"{f} is readable by others"
    for pid in info["engine_pids"].values():
        assert "--redis-url" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    with channel(info["address"], token="") as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.BatchServiceStub(ch).ListClusters(pb.ListClustersRequest(), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with channel(info["address"], token=deployment_token(info)) as ch:
        assert pb_grpc.BatchServiceStub(ch).ListClusters(pb.ListClustersRequest(), timeout=30).clusters


def test_a_killed_engine_is_restarted_and_a_killed_gateway_up_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gateway.cli", "up", "--listen", "127.0.0.1:0", "--num-clusters", "2",
           "--size", "nano", "--run-dir", str(run_dir), "--engine-arg=--max-running", "--engine-arg=4"]  # fmt: skip
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115
    up = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        info = wait_until(lambda: read_info(run_dir), 300, "fleetbatch gateway up to start")
        queue = WorkQueue(connect(info["redis_url"]))
        check_secrets(run_dir, info)
        old = info["engine_pids"]["fast"]
        os.kill(old, signal.SIGKILL)
        info = wait_until(
            lambda: (i := read_info(run_dir)) and i["engine_pids"]["fast"] != old and i, 120, "a new engine"
        )
        # the restarted engine serves again: alive, heartbeating, and the pid gateway.json names is running (a
        # restart that died at once, as a child forked beside the gateway's gRPC threads can under load, is
        # restarted again by the supervisor: up to 5 times)
        info = wait_until(
            lambda: (
                (i := read_info(run_dir))
                and (c := queue.clusters(["fast"])[0]).alive
                and c.last_heartbeat > 0
                and running(i["engine_pids"]["fast"])
                and i
            ),
            300,
            "the restarted engine's heartbeat",
        )
        assert info["engine_pids"]["fast"] != old
        children = [*info["engine_pids"].values(), info["redis_pid"]]
        assert all(running(p) for p in children)
        os.kill(up.pid, signal.SIGKILL)  # no clean-up code runs in fleetbatch gateway up
        up.wait(timeout=30)
        wait_until(lambda: not any(running(p) for p in children), 60, "engines and Redis to exit with it")
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()
    text = (tmp_path / "up.log").read_text()
    assert "engine fast exited with code -9; restarting it" in text


def test_a_clean_exit_is_not_restarted_and_a_crash_is(tmp_path):
    """An engine that exits 0 chose to stop (its cluster was removed); one that exits 3 crashed."""
    from gateway.config import ClusterSpec
    from gateway.deploy.supervisor import EngineSupervisor

    sup = EngineSupervisor(
        [ClusterSpec("clean"), ClusterSpec("crash")], "redis://unused", tmp_path, backoff_base_s=60
    )
    sup.procs = {"clean": subprocess.Popen(["true"]), "crash": subprocess.Popen(["sh", "-c", "exit 3"])}
    sup._started_at = dict.fromkeys(sup.procs, 0.0)
    for p in sup.procs.values():
        p.wait()
    assert sup.check(now=1.0) == []  # the crash waits out its backoff
    assert set(sup._due) == {"crash"}


def test_an_engine_that_stopped_by_itself_starts_again_once_its_cluster_is_active(tmp_path):
    """A preempted cluster's engine exits 0 after its notice while the cluster is draining; `gateway rebalance
    --add C --update` makes it active again, and the supervisor starts its engine after its base backoff (the
    start itself, under `gateway up`: tests/test_loadgen_spot.py). A cluster still draining, or removed, keeps
    none."""
    from gateway.config import ClusterSpec
    from gateway.deploy.supervisor import EngineSupervisor

    states = {"back": "draining", "gone": "removed"}
    sup = EngineSupervisor(
        [ClusterSpec(n) for n in states], "redis://unused", tmp_path, backoff_base_s=60,
        wanted=lambda name: states[name] == "active",
    )  # fmt: skip
    sup.procs = {n: subprocess.Popen(["true"]) for n in states}
    sup._started_at = dict.fromkeys(sup.procs, 0.0)
    for p in sup.procs.values():
        p.wait()

    def asked() -> dict[str, bool]:  # what watch() asks, in a thread, before each check
        return sup._states(sup.stopped_by_themselves())

    assert sup.check(now=1.0, active=asked()) == [] and not sup._due  # draining, removed: left alone
    states["back"] = "active"
    assert sup.check(now=2.0, active=asked()) == [] and sup._due == {"back": 62.0}
    assert sup.stopped_by_themselves() == ["gone"]
    assert sup.check(now=3.0) == [] and sup._due == {"back": 62.0}  # not asked: nothing new


def test_a_child_started_without_a_preexec_fn_still_dies_with_its_parent():
    """`fleetbatch gateway up` starts engines without a preexec_fn (no Python between fork and exec beside gRPC's threads):
    the engine asks the kernel itself, and ends at once when the parent it was given is already gone."""
    from workqueue.embedded import PARENT_ENV

    code = "from workqueue.embedded import die_with_parent_from_env as d; d(); import time; time.sleep(60)"
    gone = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, PARENT_ENV: "1"}, cwd=REPO, timeout=60
    )
    assert gone.returncode == -signal.SIGTERM
    mine = subprocess.run(
        [sys.executable, "-c", code.replace("time.sleep(60)", "print('alive')")],
        env={**os.environ, PARENT_ENV: str(os.getpid())},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert mine.returncode == 0 and mine.stdout.strip() == "alive"


def test_the_parent_variable_is_consumed_not_inherited_by_grandchildren():
    """A harness ties `fleetbatch gateway up` to itself; `fleetbatch gateway up` then runs `fleetbatch engine profile` with its own environment.
    The grandchild must not inherit the harness's pid (it would see another parent and end itself: the
    fresh-machine failure of `fleetbatch loadgen demo`, 'fleetbatch engine profile failed (exit -15)')."""
    from workqueue.embedded import PARENT_ENV

    grandchild = (
        "from workqueue.embedded import die_with_parent_from_env as d; d(); print('grandchild alive')"
    )
    child = (
        "import os, subprocess, sys\n"
        "from workqueue.embedded import PARENT_ENV, die_with_parent_from_env\n"
        "die_with_parent_from_env()\n"
        "assert PARENT_ENV not in os.environ, 'the variable was left for the children'\n"
        f"r = subprocess.run([sys.executable, '-c', {grandchild!r}], capture_output=True, text=True)\n"
        "print(r.returncode, r.stdout.strip())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", child],
        env={**os.environ, PARENT_ENV: str(os.getpid())},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0 grandchild alive"
