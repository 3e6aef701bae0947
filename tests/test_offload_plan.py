"""Offload decisions (gateway.offload.moves): link costs, which tail moves, backoff."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.assign.policies import ClusterView, QueryLoad
from gateway.offload.moves import Backoff, LinkCost, Move, link_cost, plan_offload, tail_move

FREE = LinkCost(latency_s=0.0, bandwidth_bytes_per_s=1e15)


def tail(n: int, tokens: float = 100.0, prefix: str = "t") -> list[QueryLoad]:
    return [QueryLoad(f"{prefix}{i}", 0, tokens) for i in range(n)]


def busy(name: str = "a", pending: float = 1000.0, cap: float = 1.0, **kw) -> ClusterView:
    return ClusterView(name, cap, pending_tokens=pending, **kw)


IDLE = ClusterView("b", 1.0)


def test_link_cost():
    assert LinkCost(0.01, 1000).transfer_seconds(500) == pytest.approx(0.51)
    assert LinkCost().transfer_seconds(0) == 0.005
    with pytest.raises(ValueError, match="bandwidth"):
        LinkCost(0.0, 0.0)
    with pytest.raises(ValueError, match="latency"):
        LinkCost(-1.0)
    with pytest.raises(ValueError, match="nbytes"):
        LinkCost().transfer_seconds(-1)


def test_link_lookup_either_direction_and_missing():
    ab = LinkCost(1.0)
    assert link_cost({("a", "b"): ab}, "a", "b") is ab
    assert link_cost({("a", "b"): ab}, "b", "a") is ab
    with pytest.raises(ValueError, match="no link cost configured for a -> c"):
        link_cost({("a", "b"): ab}, "a", "c")


def test_free_link_equalises_finish_times():
    # Donor finishes its k-th-from-back query at 1000 - 100(k-1); the idle one after k moves at 100k.
    assert plan_offload(IDLE, [busy()], {"a": tail(10)}, FREE) == Move("a", "b", 5, 500.0)


def test_costly_link_moves_less_or_nothing():
    # Latency 450 s: k=3 saves 800 - 300 = 500 > 450, k=4 saves 700 - 400 = 300.
    assert plan_offload(IDLE, [busy()], {"a": tail(10)}, LinkCost(450.0, 1e15)) == Move("a", "b", 3, 300.0)
    assert plan_offload(IDLE, [busy()], {"a": tail(10)}, LinkCost(2000.0, 1e15)) is None


def test_bandwidth_and_bytes_per_query():
    # 1000 bytes per query at 100 B/s: 10 s per moved query. k=1: 1000-100 > 10; ...
    # k moves cost 10k s; saved = 1000 - 100(k-1) - 100k = 1100 - 200k > 10k  <=>  k < 5.24
    move = plan_offload(IDLE, [busy()], {"a": tail(10)}, LinkCost(0.0, 100.0), bytes_per_query=lambda q: 1000)
    assert move == Move("a", "b", 5, 500.0)


def test_only_the_tail_given_can_move():
    assert plan_offload(IDLE, [busy()], {"a": tail(2)}, FREE) == Move("a", "b", 2, 200.0)


def test_busiest_donor_first():
    donors = [busy("c", pending=1000, cap=4.0), busy("a", pending=1000, cap=1.0)]
    move = plan_offload(IDLE, donors, {"a": tail(10), "c": tail(10, prefix="c")}, FREE)
    assert move is not None and move.src == "a"


def test_next_donor_when_the_busiest_tail_does_not_fit():
    idle = ClusterView("b", 1.0, max_query_tokens=200)
    donors = [busy("a", pending=5000), busy("c", pending=1000)]
    tails = {"a": tail(3, tokens=1000), "c": tail(10, prefix="c")}
    assert plan_offload(idle, donors, tails, FREE) == Move("c", "b", 5, 500.0)


def test_moves_stop_at_the_first_query_that_does_not_fit():
    idle = ClusterView("b", 1.0, kv_budget_tokens=150)
    t = [QueryLoad("x0", 0, 100.0), QueryLoad("x1", 0, 500.0), QueryLoad("x2", 0, 100.0)]
    assert plan_offload(idle, [busy()], {"a": t}, FREE) == Move("a", "b", 1, 100.0)


def test_idle_threshold_and_not_accepting():
    nearly = ClusterView("b", 1.0, pending_tokens=50)
    assert plan_offload(nearly, [busy()], {"a": tail(10)}, FREE) is None
    assert plan_offload(nearly, [busy()], {"a": tail(10)}, FREE, idle_threshold_tokens=100) == Move(
        "a", "b", 5, 500.0
    )
    draining = ClusterView("b", 1.0, accepting=False)
    assert plan_offload(draining, [busy()], {"a": tail(10)}, FREE) is None
    with pytest.raises(ValueError, match="idle_threshold_tokens"):
        plan_offload(IDLE, [busy()], {"a": tail(10)}, FREE, idle_threshold_tokens=-1)


def test_no_donor_or_no_gain():
    assert plan_offload(IDLE, [busy()], {}, FREE) is None
    assert plan_offload(IDLE, [busy()], {"a": []}, FREE) is None
    assert plan_offload(IDLE, [IDLE], {"b": tail(3)}, FREE) is None  # never from itself
    quiet = busy(pending=100)
    assert plan_offload(IDLE, [quiet], {"a": tail(1)}, FREE) is None  # 100 vs 100: no gain


def test_dead_donor_gives_its_whole_tail():
    dead = ClusterView("a", 0.0, pending_tokens=1000)
    assert plan_offload(IDLE, [dead], {"a": tail(10)}, LinkCost()) == Move("a", "b", 10, 1000.0)


def test_per_link_costs():
    links = {("a", "b"): LinkCost(2000.0), ("c", "b"): FREE}
    donors = [busy("a", pending=1000), busy("c", pending=900)]
    move = plan_offload(IDLE, donors, {"a": tail(10), "c": tail(9, prefix="c")}, links)
    assert move is not None and move.src == "c"


def test_a_fill_horizon_takes_past_equal_finish_times():
    """The cost policy's fill (gateway.assign.cost_moves.fill_rule): a cheaper idle cluster takes the tail while it
    finishes what it takes within ``until_s``, past the equal finish times of a plain move (500 tokens here)."""
    assert tail_move(busy(), IDLE, tail(10), FREE, until_s=801.0) == Move("a", "b", 8, 800.0)
    assert tail_move(busy(), IDLE, tail(10), LinkCost(2.0, 1e15), until_s=801.0) == Move("a", "b", 7, 700.0)
    assert tail_move(busy(), IDLE, tail(10), FREE, until_s=300.0) == Move("a", "b", 5, 500.0)  # at least that
    assert tail_move(busy(), IDLE, tail(10), FREE, until_s=5000.0) == Move("a", "b", 10, 1000.0)
    fill = {"a": 701.0, "c": None}.get
    move = plan_offload(IDLE, [busy()], {"a": tail(10)}, FREE, fill=lambda donor, idle: fill(donor.name))
    assert move == Move("a", "b", 7, 700.0)
    # the fill is asked of each donor with the idle cluster; None there is the plain move
    asked = []
    plan_offload(IDLE, [busy("c")], {"c": tail(10)}, FREE, fill=lambda d, i: asked.append((d.name, i.name)))
    assert asked == [("c", "b")]
    assert plan_offload(IDLE, [busy("c")], {"c": tail(10)}, FREE, fill=lambda d, i: None) == Move(
        "c", "b", 5, 500.0
    )


@settings(max_examples=200, deadline=None)
@given(
    st.floats(1, 1e5),
    st.floats(0.1, 50),
    st.floats(0.1, 50),
    st.lists(st.tuples(st.integers(0, 300), st.floats(0, 2000)), min_size=0, max_size=30),
    st.floats(0, 5),
    st.floats(1e3, 1e9),
)
def test_move_properties(pending, cap_d, cap_r, items, latency, bandwidth):
    t = [QueryLoad(f"q{i}", p, r) for i, (p, r) in enumerate(items)]
    donor = ClusterView("d", cap_d, pending_tokens=pending + sum(q.total_tokens for q in t))
    recipient = ClusterView("r", cap_r)
    link = LinkCost(latency, bandwidth)
    move = tail_move(donor, recipient, t, link)
    if move is None:
        return
    assert 1 <= move.count <= len(t)
    moved = t[len(t) - move.count :]
    assert move.tokens == pytest.approx(sum(q.total_tokens for q in moved))
    transfer = link.transfer_seconds(sum(4 * q.prompt_tokens + 512 for q in moved))
    # The frontmost moved query finishes earlier at the recipient, transfer included.
    at_donor = (donor.pending_tokens - move.tokens + moved[0].total_tokens) / cap_d
    assert move.tokens / cap_r + transfer < at_donor + 1e-9 * at_donor
    # Maximal: one more query would not pay (or there is none).
    if move.count < len(t):
        nxt = t[len(t) - move.count - 1]
        more = move.tokens + nxt.total_tokens
        transfer2 = link.transfer_seconds(sum(4 * q.prompt_tokens + 512 for q in [nxt, *moved]))
        assert (donor.pending_tokens - move.tokens) / cap_d - more / cap_r <= transfer2 + 1e-9 * more


@settings(max_examples=200, deadline=None, derandomize=True)  # the same cases every run
@given(
    st.floats(1, 1e5),
    st.floats(0.1, 50),
    st.floats(0.1, 50),
    st.lists(st.floats(0, 2000), min_size=1, max_size=30),
    st.floats(0, 5),
    st.floats(0, 1e4),
)
def test_a_fill_moves_the_longest_prefix_that_pays_or_fits_the_horizon(
    pending, cap_d, cap_r, sizes, latency, until
):
    """With ``until_s`` a count is taken when it pays or the recipient finishes it within the horizon, transfer
    included; both hold for a prefix of the counts, so the move is the longest count for which either does."""
    t = [QueryLoad(f"q{i}", 0, r) for i, r in enumerate(sizes)]
    donor = ClusterView("d", cap_d, pending_tokens=pending + sum(sizes))
    recipient = ClusterView("r", cap_r)
    link = LinkCost(latency, 1e15)
    move = tail_move(donor, recipient, t, link, until_s=until)
    plain = tail_move(donor, recipient, t, link)

    def ok(k: int) -> bool:  # k queries from the back: the rule of the docstring
        moved = sum(sizes[len(sizes) - k :])
        front = sizes[len(sizes) - k]
        at_donor = (donor.pending_tokens - moved + front) / cap_d
        transfer = link.transfer_seconds(512 * k)
        return at_donor - moved / cap_r > transfer or moved / cap_r + transfer <= until

    longest = 0
    while longest < len(sizes) and ok(longest + 1):
        longest += 1
    assert (move.count if move else 0) == longest
    assert (move.count if move else 0) >= (plain.count if plain else 0)  # never less than the plain move


# ---- backoff --------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_caps_and_resets():
    clock = FakeClock()
    b = Backoff(base_s=0.5, factor=2.0, max_s=3.0, clock=clock)
    assert b.ready() and b.delay_s == 0.0
    delays = []
    for _ in range(5):
        b.failed()
        delays.append(b.delay_s)
        assert not b.ready()
        clock.now += b.delay_s - 0.01
        assert not b.ready()
        clock.now += 0.01
        assert b.ready()
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.failed()
    b.succeeded()
    assert b.ready() and b.failures == 0 and b.delay_s == 0.0
    b.failed()
    assert b.delay_s == 0.5


def test_backoff_many_failures_do_not_overflow():
    b = Backoff(clock=FakeClock())
    for _ in range(5000):
        b.failed()
    assert b.delay_s == 30.0 and not math.isinf(b.delay_s)


def test_backoff_validation():
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=0)
    with pytest.raises(ValueError, match="factor"):
        Backoff(factor=0.5)
    with pytest.raises(ValueError, match="max_s"):
        Backoff(base_s=2.0, max_s=1.0)


def test_backoffs_are_independent():
    clock = FakeClock()
    a, b = Backoff(clock=clock), Backoff(clock=clock)
    a.failed()
    assert not a.ready() and b.ready()
