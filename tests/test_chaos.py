"""`loadgen chaos` in CI: every fault kind injected into one real deployment while a batch runs.

SIGKILL of an engine, SIGSTOP of an engine past its lease, SIGKILL and restart of a gateway
replica while the client streams with ``start_index``, SIGKILL and restart of Redis (AOF
``everysec``), and admin rebalances racing two offloaders. Afterwards every query has exactly
one result, none is stuck, the queue invariants hold, and every engine is back by itself."""

from __future__ import annotations

import pytest

from load.chaos import FAULTS, ChaosConfig, run_chaos

pytestmark = pytest.mark.fault


def test_every_fault_kind_in_one_run_loses_doubles_and_strands_nothing(tmp_path):
    report = run_chaos(ChaosConfig(run_dir=tmp_path / "chaos"))
    assert report["faults"] == dict.fromkeys(FAULTS, 1), report
    assert (report["lost"], report["duplicated"], report["stuck"]) == (0, 0, 0), report
    assert report["invariant_violations"] == 0, report
    assert report["client_received"] == report["queries"], report
    assert report["engines_alive"] == 2 and report["engine_restarts"] >= 1, report
