"""The endpoint backend's flow control, fed outcomes by hand: the backoff, the choice of endpoint and the
measured rate (no server, no clock: every time is given; the limit: tests/test_endpoint_limit.py)."""

from __future__ import annotations

import pytest

from engines.endpoint_flow import (
    Backoff,
    FlowSettings,
    Lane,
    RateMeter,
    least_loaded,
    next_opening,
)

FLOW = FlowSettings(initial_limit=2.0, max_limit=8, backoff_base_s=0.25, backoff_max_s=8.0)


def test_backoff_doubles_per_failure_but_once_for_requests_that_failed_together():
    b = Backoff(FLOW)
    assert b.ready(0.0)
    assert b.failed(now=10.0, sent_at=9.0) == 0.25
    assert b.failed(now=10.1, sent_at=9.5) == pytest.approx(0.15)  # in flight with the first: no doubling
    assert not b.ready(10.2) and b.ready(10.25)
    assert b.failed(now=11.0, sent_at=10.5) == 0.5  # sent after the last failure: doubles
    assert b.failed(now=12.0, sent_at=11.5) == 1.0
    for k in range(10):
        b.failed(now=20.0 + k, sent_at=19.5 + k)
    assert b.until - b.failed_at == 8.0  # capped
    b.succeeded()
    assert b.ready(0.0) and b.failed(now=50.0, sent_at=49.0) == 0.25


def test_retry_after_lengthens_the_wait_up_to_the_maximum():
    b = Backoff(FLOW)
    assert b.failed(now=0.0, sent_at=0.0, retry_after_s=3.0) == 3.0
    assert Backoff(FLOW).failed(now=0.0, sent_at=0.0, retry_after_s=600.0) == 8.0


def test_the_least_loaded_open_endpoint_is_chosen():
    a, b, c = (Lane.of(u, FLOW) for u in ("http://a/v1", "http://b/v1", "http://c/v1"))
    assert least_loaded([a, b, c], 0.0) is a  # the first of equals
    a.inflight = 2  # at its limit (2): closed
    b.inflight = 1
    assert least_loaded([a, b, c], 0.0) is c
    c.backoff.failed(now=0.0, sent_at=0.0)  # backing off until 0.25
    assert least_loaded([a, b, c], 0.1) is b
    assert next_opening([a, b, c], 0.1) == pytest.approx(0.15)
    b.inflight = 2
    assert least_loaded([a, b, c], 0.1) is None
    assert least_loaded([a, b, c], 0.3) is c


def test_the_rate_is_tokens_per_busy_second():
    m = RateMeter(window_s=100.0)
    assert m.rate() == 0.0
    m.busy(0.0, 1)
    m.add(2.0, 40)  # 40 tokens in 2 busy seconds
    m.busy(2.0, 0)
    m.busy(50.0, 1)  # 48 idle seconds do not count
    m.add(52.0, 60)
    assert m.rate() == pytest.approx(100 / 4)
    assert m.tokens == 100


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="in-flight limit"):
        FlowSettings(max_limit=0)
    with pytest.raises(ValueError, match="initial limit"):
        FlowSettings(initial_limit=9.0, max_limit=8)
