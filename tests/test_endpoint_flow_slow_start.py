"""The endpoint backend's slow start (``FlowSettings.slow_start``, on in ``fleetbatch engine serve``): the
in-flight limit grows by one a success until the time per token rises or the endpoint overloads, then
by one a window as before (no server, no clock: outcomes fed by hand)."""

from __future__ import annotations

from types import SimpleNamespace

from engines.endpoint_flow import FlowSettings, InflightLimit
from engines.endpoint_settings import EndpointSettings

SLOW_START = FlowSettings(initial_limit=2.0, max_limit=8, slow_start=True)


def test_slow_start_grows_by_one_a_success_to_the_maximum():
    limit = InflightLimit(SLOW_START)
    for _ in range(6):
        limit.succeeded(0.01, saturated=True)
    assert limit.limit == 8.0 and limit.slow_start  # 2 -> 8 in six requests, not 27


def test_slow_start_ends_at_the_first_rise_then_the_limit_grows_by_one_a_window():
    limit = InflightLimit(SLOW_START)
    limit.succeeded(0.01, saturated=True)  # 3
    for _ in range(3):
        limit.succeeded(0.05, saturated=True)  # 5x slower per token: no growth, slow start over
    assert not limit.slow_start and limit.limit == 3.0
    limit.succeeded(0.0, saturated=True)
    assert limit.limit < 4.0  # a third, not one


def test_an_overload_ends_slow_start():
    limit = InflightLimit(SLOW_START)
    limit.succeeded(0.01, saturated=True)
    assert limit.overloaded(limit.window) and limit.limit == 1.5 and not limit.slow_start


def test_engine_serve_turns_slow_start_on():
    args = SimpleNamespace(
        served_model=None, endpoint_url=["http://127.0.0.1:1"], served_model_name=None, endpoint_key_file=None,
        endpoint_timeout_s=60.0, endpoint_give_up_s=300.0, max_running=8,
    )  # fmt: skip
    flow = EndpointSettings.from_args(args).flow
    assert flow.slow_start and flow.initial_limit == 2.0 and flow.max_limit == 8
