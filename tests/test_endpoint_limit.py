"""The in-flight limit climbed on an endpoint's throughput (engines.endpoint_limit), fed the answers of a
modelled server (no server, no clock: each answer's time comes from the model's rate at the limit)."""

from __future__ import annotations

from types import SimpleNamespace

from engines.endpoint_limit import ThroughputLimit
from engines.endpoint_settings import EndpointSettings
from engines.vllm_args import DefaultCount

#: completion tokens/s of `transformers serve --continuous-batching` (random small Llama, one core) at each
#: number in flight, as `fleetbatch loadgen endpoints` measured it with a plain client
MEASURED = {1: 60.2, 2: 70.5, 4: 123.2, 8: 169.9, 16: 199.0, 32: 171.4, 64: 126.2, 128: 100.1}
TOKENS = 46  # a row's completion tokens


def server_rate(level: int) -> float:
    """The modelled server's tokens/s at ``level`` in flight: ``MEASURED``, linear in between."""
    points = sorted(MEASURED)
    if level >= points[-1]:
        return MEASURED[points[-1]]
    lo = max(p for p in points if p <= level)
    hi = min(p for p in points if p >= level)
    return (
        MEASURED[lo] if lo == hi else MEASURED[lo] + (MEASURED[hi] - MEASURED[lo]) * (level - lo) / (hi - lo)
    )


def run(limit: ThroughputLimit, answers: int, rate=server_rate) -> tuple[list[int], float]:
    """Feed ``answers`` answers, each at the modelled rate of the limit it was sent under; the levels the
    limit had at each answer, and the seconds they took."""
    now, levels = 0.0, []
    for _ in range(answers):
        level = limit.slots
        now += TOKENS / rate(level)
        limit.succeeded(TOKENS, now, level - (len(levels) % 2))  # a slot now and then not yet refilled
        levels.append(level)
    return levels, now


def test_the_limit_climbs_to_the_servers_best_and_holds_there():
    limit = ThroughputLimit(initial_limit=4, max_limit=256)
    levels, took = run(limit, 400)
    assert 12 <= limit.slots <= 24  # the best is 16; a quarter-step probe may be under way
    assert max(levels) <= 32  # the climb stopped at the first level that did not pay
    at_best = sum(1 for lvl in levels[100:] if 12 <= lvl <= 24)
    assert at_best >= 0.9 * len(levels[100:])
    best = 400 * TOKENS / max(MEASURED.values())
    assert best / took >= 0.93  # the whole run, climb included, against the best fixed level throughout


def test_an_unused_limit_learns_nothing():
    limit = ThroughputLimit(initial_limit=4, max_limit=256)
    for i in range(200):  # half the limit in flight: no evidence more would help
        limit.succeeded(TOKENS, float(i), limit.slots // 2)
    assert limit.slots == 4 and limit.rates == {}


def test_an_overload_halves_the_limit_once_a_round_and_caps_the_climb_for_a_while():
    limit = ThroughputLimit(initial_limit=4, max_limit=256)
    run(limit, 200)
    level = limit.slots
    sent = limit.window
    assert limit.overloaded(sent) and limit.slots == level // 2
    assert not limit.overloaded(sent)  # sent before the halving: the same overload, seen again
    assert limit.ceiling <= level
    levels, _ = run(limit, 400)  # the server is fine again: the ceiling rises a step at a time
    assert max(levels[-100:]) >= level // 2 and limit.slots >= 12


def test_a_server_that_serves_one_at_a_time_keeps_a_small_limit():
    def one_at_a_time(level: int) -> float:
        return 100.0 / (1 + 0.05 * (level - 1))  # no batching: more in flight only queues

    limit = ThroughputLimit(initial_limit=4, max_limit=256)
    levels, _ = run(limit, 300, one_at_a_time)
    assert max(levels) <= 8 and limit.slots <= 4


def test_max_running_bounds_the_limit_only_where_it_is_given():
    def args(max_running):
        return SimpleNamespace(
            served_model=None, endpoint_url=["http://127.0.0.1:1"], served_model_name=None,
            endpoint_key_file=None, endpoint_timeout_s=60.0, endpoint_give_up_s=300.0, max_running=max_running,
        )  # fmt: skip

    assert (
        EndpointSettings.from_args(args(DefaultCount(8))).flow.max_limit == 256
    )  # the default: climb freely
    given = EndpointSettings.from_args(args(6)).flow
    assert (given.max_limit, given.initial_limit) == (6, 4.0)
    limit = ThroughputLimit(initial_limit=given.initial_limit, max_limit=given.max_limit)
    levels, _ = run(limit, 200)
    assert max(levels) <= 6
