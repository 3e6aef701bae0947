"""`fleetbatch loadgen chaos` in CI: all fifteen fault kinds injected into one real deployment while batches run.

SIGKILL and SIGSTOP of busy engines, SIGKILL of Redis and a Redis outage of more than twice the
lease, a partition between an engine and Redis (a TCP proxy blackhole), racing admin rebalances,
rows that exhaust the KV cache, an unwritable file store while an OpenAI batch finalizes, an
engine restart during background intake, a SIGKILL of a gateway replica, and the removal of
a cluster holding a row only it can take; and (issue 48) replies lost after Redis ran the call, on an
engine's link (a claim, a result write) and on the gateways' (an intake chunk, a cancel), a Redis kept
busy by a script past the clients' reply timeout, and the cancel of a 20,000-row batch at the head of
the queues. Faults follow the load's progress (waves), so each fires on any machine; the lease (3 s), outage and partition are short here, the CLI's defaults
are the realistic ones. Every fault must bite (its evidence in ``evidence``): a fault that
fired without effect does not count.

Some counts expose the bugs of issue 31 that other branches fix (a KV-exhausting row missing
from the OpenAI files, a finalizer giving up on a full disk, intake failing rows while their
only cluster restarts, a removed cluster stranding its queue); the test asserts the goal, so it
fails until those fixes are merged."""

from __future__ import annotations

import json

import pytest

from load.chaos.books import CHECKED, verdict
from load.chaos.run import FAULTS, ChaosConfig, run_chaos

pytestmark = pytest.mark.fault


def test_a_run_whose_faults_did_not_all_bite_or_that_lost_a_restart_or_a_client_fails():
    report = {"faults": dict.fromkeys(FAULTS, 1), **dict.fromkeys(CHECKED, 0)}
    assert verdict(report, FAULTS) == []
    report["faults"]["partition"] = 0
    report["fault_misses"] = {"partition": "no connection was frozen, held, dropped or refused"}
    report["engines_not_restarted"] = 1
    report["client_failures"] = ["w3: SubmitBatch on 127.0.0.1:1: INVALID_ARGUMENT bad"]
    assert verdict(report, FAULTS) == [
        "engines_not_restarted = 1",
        "partition did not bite: no connection was frozen, held, dropped or refused",
        "faults that did not bite: partition (14 of 15 kinds)",
        "client: w3: SubmitBatch on 127.0.0.1:1: INVALID_ARGUMENT bad",
    ]


def test_every_fault_kind_in_one_run_loses_doubles_and_strands_nothing(tmp_path):
    config = ChaosConfig(
        run_dir=tmp_path / "chaos",
        queries=96,  # 16 waves of 6: each fault still fires while its wave's rows hold leases
        lease_s=3.0,
        stop_s=7.0,  # past twice the lease: the stopped engine's leases lapse
        outage_s=7.0,  # at least twice the lease (ChaosConfig refuses less)
        partition_s=7.0,
        store_s=2.0,  # the finalizer's failed pass is seen before this hold; the batch must complete after
        settle_s=60.0,
        restart_timeout_s=180.0,
        large_cancel_rows=5_000,
        # a time: judged by the benchmark run (docs/BENCHMARKS.md, 15.4 ms at 100,000 rows); four workers on two
        # cores deschedule Redis mid-script (54.7 ms once), so here the figure is read, not judged
        blocked_goal_ms=None,
    )
    report = run_chaos(config)
    print(json.dumps(report))
    assert report["faults"] == dict.fromkeys(FAULTS, 1), report["fault_misses"]
    assert report["attempts_used_by_lost_replies"] == 0, report["evidence"]["reply_lost_engine"]
    cancelled = report["evidence"]["large_cancel"]
    assert report["redis_max_blocked_ms"] > 0 and cancelled["slowlog_entries"] > 0, cancelled
    assert report["client_failures"] == [], report
    assert report["engine_restarts"] >= 2 and report["engines_not_restarted"] == 0, report
    assert {k: report[k] for k in CHECKED} == dict.fromkeys(CHECKED, 0), report
    assert report["ok"], report["problems"]


def test_a_fault_that_fires_on_a_finished_wave_does_not_count(tmp_path):
    """``--fire-at 1``: the fault fires once its wave is done, so no engine holds a lease. The old
    harness SIGKILLed an idle engine and counted the fault; now it is a miss and the run fails."""
    config = ChaosConfig(
        run_dir=tmp_path / "chaos",
        queries=4,
        lease_s=3.0,
        fire_at=1.0,
        settle_s=60.0,
        faults=("kill_engine",),
    )
    report = run_chaos(config)
    print(json.dumps(report))
    assert report["faults"]["kill_engine"] == 0, report["evidence"]
    assert "held a lease" in report["fault_misses"]["kill_engine"], report["fault_misses"]
    assert not report["ok"] and any("kill_engine did not bite" in p for p in report["problems"]), report
    assert report["lost"] == report["stuck"] == 0, report


def test_the_wan_options_reach_the_config_and_bad_values_are_refused(tmp_path):
    import argparse

    from load.chaos.config import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    c = config_from_args(
        p.parse_args(["--wan-delay-ms", "50", "--partition-s", "60", "--run-dir", str(tmp_path)])
    )
    assert (c.wan_delay_ms, c.wan_jitter_ms, c.partition_s, c.wan) == (50.0, 0.0, 60.0, True)
    assert not ChaosConfig(run_dir=tmp_path).wan  # by default only the partitioned engine has a proxy
    for bad in ({"wan_delay_ms": -1.0}, {"wan_jitter_ms": float("inf")}, {"partition_s": -5.0}):
        with pytest.raises(ValueError, match="finite number >= 0"):
            ChaosConfig(run_dir=tmp_path, **bad)
