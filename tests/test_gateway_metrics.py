"""The gateway's Prometheus endpoint: only a scrape with the admin token reads it (the series name every
client's batches), and the ``batch`` label's values are bounded (issue 48, finding 7)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from gateway.status.eta import Eta
from gateway.status.metrics import GatewayMetrics

TOKEN = "metrics-admin-token-0123456789"


def scrape(port: int, auth: str | None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if auth is not None:
        req.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_scrape_without_the_admin_token_is_refused():
    metrics = GatewayMetrics()
    metrics.batches.inc()
    server = metrics.serve(0, "127.0.0.1", TOKEN)
    try:
        port = server.server_port
        for auth in (None, "Bearer wrong-token-0123456789", TOKEN, f"Basic {TOKEN}"):
            status, body = scrape(port, auth)
            assert status == 401 and "fleetbatch_batches_submitted" not in body, auth
        status, body = scrape(port, f"Bearer {TOKEN}")
        assert status == 200 and "fleetbatch_batches_submitted_total 1.0" in body
    finally:
        server.shutdown()
        server.server_close()


def test_no_endpoint_without_a_token():
    with pytest.raises(ValueError, match="admin token"):
        GatewayMetrics().serve(0, "127.0.0.1", "")


def eta(finish_at: float, at_risk: bool = False) -> Eta:
    return Eta(finish_at, 100.0, 1.0, 0.5, at_risk)


def batch_labels(metrics: GatewayMetrics, name: str) -> set[str]:
    return {s.labels["batch"] for m in metrics.registry.collect() if m.name == name for s in m.samples}


def test_the_batch_labels_are_bounded_at_risk_first_then_the_earliest_finish():
    metrics = GatewayMetrics(max_batches=3)
    etas = {f"b{i:04d}": eta(1000.0 + i) for i in range(500)}
    etas["late-but-at-risk"] = eta(9999.0, at_risk=True)
    metrics.observe_etas(etas, now=900.0)
    want = {"late-but-at-risk", "b0000", "b0001"}
    assert batch_labels(metrics, "fleetbatch_batch_eta_seconds") == want
    assert batch_labels(metrics, "fleetbatch_batch_token_progress") == want
    assert metrics.at_risk._value.get() == 1  # counted over every batch, shown or not
    # batches that finished (no longer in the board) lose their series at the next refresh
    metrics.observe_etas({"b0499": eta(1499.0)}, now=900.0)
    assert batch_labels(metrics, "fleetbatch_batch_eta_seconds") == {"b0499"}
    with pytest.raises(ValueError):
        GatewayMetrics(max_batches=-1)
