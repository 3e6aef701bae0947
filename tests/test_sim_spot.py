"""The simulator's spot clusters (sim.spot): notices and kills of real simulated engines, queries resumed from their
partial output, the billing model, the cost policy's window; the replay of a ``fleetbatch loadgen spot`` run
directory (sim.spot_replay) and the synthetic preemption process of ``fleetbatch sim spot-scale``."""

from __future__ import annotations

import json
import random

import pytest

from sim.cli import main
from sim.core import ClusterSpec, SimConfig, Simulator
from sim.costs import LinearCost
from sim.spot import Market, Outage, SpotSimulator
from sim.spot_replay import read_spot_run, replay
from sim.spot_scale import preemptions
from sim.workload import Workload
from tests.test_sim_pipelined import cost, write_plan

PRICES = {"fast": 5.86, "medium": 0.849, "slow": 0.21}
SPOT = frozenset({"medium", "slow"})
TICK_S = SimConfig().offload_interval_s


def fleet() -> list[ClusterSpec]:
    return [
        ClusterSpec("fast", LinearCost().with_speed(4.0)),
        ClusterSpec("medium", LinearCost().with_speed(2.0)),
        ClusterSpec("slow", LinearCost()),
    ]


def workload(n: int = 240, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    true = [rng.randint(20, 200) for _ in range(n)]
    return Workload([rng.randint(10, 120) for _ in range(n)], true, [float(t) for t in true], [0.0] * n)


def makespan(w: Workload) -> float:
    return Simulator(fleet(), w, SimConfig(max_tokens=256)).run().makespan_s


def test_notices_give_back_running_queries_that_resume_where_they_stopped():
    w = workload()
    t = makespan(w)
    outages = [
        Outage(name, share * t, "preempt", notice_s=0.01, back_t=(share + 0.1) * t)
        for share in (0.2, 0.5)
        for name in ("medium", "slow")
    ]
    r = SpotSimulator(fleet(), w, SimConfig(max_tokens=256), Market(PRICES, SPOT), outages).run()
    assert (
        r.spot["outages"] == 4 and r.spot["checkpointed_queries"] > 0
    )  # running queries really were stopped
    assert r.spot["recomputed_tokens"] == 0  # a notice keeps every token
    assert all(f > 0 for f in r.finish_s)  # every query finished, and once (the run ends at n finishes)
    assert r.generated_tokens == sum(w.true_tokens)  # resumed queries decoded only what was left


def test_a_kill_loses_at_most_half_a_checkpoint_of_each_running_query():
    w = workload()
    t = makespan(w)
    outages = [Outage(name, 0.3 * t, "kill", back_t=0.4 * t) for name in ("medium", "slow")]
    market = Market(PRICES, SPOT, checkpoint_tokens=16, lease_s=0.5)
    r = SpotSimulator(fleet(), w, SimConfig(max_tokens=256), market, outages).run()
    killed, lost = r.spot["killed_running_queries"], r.spot["recomputed_tokens"]
    assert killed > 0 and 0 < lost <= killed * 7  # a snapshot every 16 / 2 tokens: at most 7 since the last
    assert r.generated_tokens == sum(w.true_tokens) + lost  # the lost tokens, generated twice
    assert all(f > 0 for f in r.finish_s)


def test_a_cluster_is_billed_while_it_holds_work_and_one_given_none_costs_nothing():
    w = workload()
    window = 100 * makespan(w)  # a loose window: the cheap clusters alone meet it
    cfg = SimConfig(policy="cost", offload=False, max_tokens=256)
    sim = SpotSimulator(fleet(), w, cfg, Market(PRICES, SPOT, window_s=window))
    r = sim.run()
    assert r.per_cluster["fast"]["queries"] == 0 and r.per_cluster["fast"]["cost_dollars"] == 0
    for i, name in enumerate(PRICES):
        ran = [
            f for q, f in enumerate(r.finish_s) if sim.assigned[q] == i
        ]  # no moves: it ran what it was given
        per_s = PRICES[name] / 3600
        billed = per_s * max(ran, default=0.0)  # from the start to its last query's end
        assert r.per_cluster[name]["cost_dollars"] == pytest.approx(billed, abs=per_s * TICK_S + 1e-6)
    assert r.per_cluster["slow"]["cost_dollars"] > 0
    assert r.cost_dollars == pytest.approx(sum(c["cost_dollars"] for c in r.per_cluster.values()), abs=1e-5)


def test_the_cost_policy_takes_the_dear_fast_cluster_only_when_the_window_needs_it():
    w = workload()
    t = makespan(w)
    cfg = SimConfig(policy="cost", max_tokens=256)
    loose = SpotSimulator(fleet(), w, cfg, Market(PRICES, SPOT, window_s=100 * t)).run()
    tight = SpotSimulator(fleet(), w, cfg, Market(PRICES, SPOT, window_s=1.6 * t)).run()
    assert loose.per_cluster["fast"]["queries"] == 0 and tight.per_cluster["fast"]["queries"] > 0
    assert tight.makespan_s < loose.makespan_s and tight.cost_dollars > loose.cost_dollars


def test_a_cluster_that_never_comes_back_with_work_queued_is_a_stall_not_a_hang():
    w = workload(20)
    alone = [ClusterSpec("slow", LinearCost())]
    with pytest.raises(RuntimeError, match="stalled"):
        SpotSimulator(alone, w, SimConfig(max_tokens=256), outages=[Outage("slow", 0.5, notice_s=0.1)]).run()


def test_the_cost_policy_times_a_derived_capacity_in_work_units():
    """The cost LP's finish for a cluster whose capacity the cost model derived is the one the run has."""
    w = workload()
    t = makespan(w)
    sim = SpotSimulator(
        fleet(), w, SimConfig(policy="cost", max_tokens=256), Market(PRICES, SPOT, window_s=3 * t)
    )
    views = [sim._view(c) for c in sim.clusters]
    assert [v.capacity_tps for v in views] == pytest.approx(
        [c.capacity * sim.work_per_token for c in sim.clusters]
    )
    r = sim.run()  # the spot clusters' shares are sized to half the window: they are done within it
    assert r.makespan_s <= 3 * t and r.per_cluster["fast"]["queries"] > 0


def sim_policy_margin(run: str) -> float:
    sim, _ = read_spot_run(run)
    return sim.policy.spot_margin


def test_a_larger_spot_margin_saves_where_the_window_allows():
    """Within half a window of 2 T the spot clusters' horizon is T itself: the dear cluster is billed as long as the
    token split bills it. With 0.8 of the window the spot clusters take more of the batch, the dear one is released
    sooner and the fleet costs less."""
    w = workload()
    t = makespan(w)
    cfg = SimConfig(policy="cost", max_tokens=256)
    cost = {
        m: SpotSimulator(fleet(), w, cfg, Market(PRICES, SPOT, window_s=2 * t, spot_margin=m)).run()
        for m in (0.5, 0.8)
    }
    assert cost[0.8].cost_dollars < cost[0.5].cost_dollars
    assert cost[0.8].per_cluster["fast"]["cost_dollars"] < cost[0.5].per_cluster["fast"]["cost_dollars"]
    assert cost[0.8].makespan_s <= 2 * t  # the window is met all the same


class EqualFinishSimulator(SpotSimulator):
    """The offloader as it was: a cheaper idle cluster takes a dear one's tail only to equal finish times."""

    def _fill(self, donor, recipient):
        return None


def test_spot_clusters_back_from_a_notice_take_their_share_back_from_the_dear_cluster():
    """Both spot clusters get a notice at once: their queues drain to fast, the only cluster up. Back 0.05 T later,
    under the cost policy each fills from fast's tail up to its horizon, not only to equal finish times (which left
    most of the drained work on fast): fast answers fewer queries, is released sooner and the fleet costs less,
    within the window all the same."""
    w = workload()
    t = makespan(w)
    outages = [Outage(n, 0.2 * t, "preempt", notice_s=0.01, back_t=0.25 * t) for n in ("medium", "slow")]
    cfg, market = (
        SimConfig(policy="cost", max_tokens=256),
        Market(PRICES, SPOT, window_s=2 * t, spot_margin=0.8),
    )
    fill = SpotSimulator(fleet(), w, cfg, market, outages).run()
    equal = EqualFinishSimulator(fleet(), w, cfg, market, outages).run()
    assert fill.per_cluster["fast"]["queries"] < equal.per_cluster["fast"]["queries"]
    assert fill.cost_dollars < equal.cost_dollars and fill.makespan_s <= 2 * t
    assert fill.per_cluster["medium"]["moved_in"] > 0  # it took work back


def test_a_notice_under_the_cost_policy_drains_and_balances_as_the_admin_call_does():
    """`gateway rebalance --preempt` drains the cluster and then balances the rest to the cost split. Here every
    query waits on fast and slow gets a notice: the balance gives medium, on spot and cheaper per token, what it
    finishes within half the window (a loose one, 4 T), past equal finish times, and fast, dear, the rest."""
    w = workload()
    t = makespan(w)
    cfg = SimConfig(policy="cost", max_tokens=256)
    sim = SpotSimulator(fleet(), w, cfg, Market(PRICES, SPOT, window_s=4 * t))
    fast, medium, slow = sim.clusters
    for q in range(len(w.true_tokens)):
        fast.queue.append(q, sim.key[q])
        fast.queued_tokens += sim.charge[q]
    slow.down = True
    sim._notice_rebalance(slow)
    # what medium took it holds queued or has started (a move wakes the cluster it lands on)
    taken = len(medium.queue) + len(medium.engine.held())
    assert len(fast.queue) + taken == len(w.true_tokens) and not slow.queue and taken > 0

    def busy_s(c) -> float:
        view = sim._view(c)
        return view.pending_tokens * sim.work_per_token / view.capacity_tps

    assert busy_s(fast) < busy_s(medium) <= 0.5 * 4 * t  # fast is released first; medium within its horizon


def test_outages_are_checked():
    with pytest.raises(ValueError, match="unknown clusters: nowhere"):
        SpotSimulator(fleet(), workload(10), outages=[Outage("nowhere", 1.0)])
    with pytest.raises(ValueError, match="preempt or a kill"):
        Outage("slow", 1.0, "reboot")
    static = [ClusterSpec("slow", LinearCost(), backend="static")]
    with pytest.raises(ValueError, match="static engines"):
        SpotSimulator(static, workload(10), outages=[Outage("slow", 1.0)])


def spot_run(tmp_path) -> tuple[str, dict]:
    """A run directory as ``fleetbatch loadgen spot`` writes it, made from a simulated run of the same setup
    (so that the replay must give back exactly its cost and makespan), and what that run was."""
    run = tmp_path / "cost_loose"
    (run / "deploy" / "plans").mkdir(parents=True)
    for name, layer_s in (("fast", 0.0005), ("slow", 0.002)):
        write_plan(run / "deploy" / "plans" / f"{name}.ilp.json", [0, 2], [cost(layer_s)], mb=(2, 2))
    (run / "clusters.yaml").write_text(
        "version: 1\nclusters:\n- name: fast\n  devices: [A100-40G]\n"
        "- name: slow\n  devices: [T4]\n  market: spot\n"
    )
    n, t0 = 40, 1000.0
    rng = random.Random(1)
    rows = [
        {"query_id": f"q-{i:06d}", "prompt_tokens": rng.randint(5, 30), "completion_tokens": rng.randint(10, 60),
         "predicted_tokens": float(rng.randint(10, 60))}
        for i in range(n)
    ]  # fmt: skip
    window = 30.0
    events = [
        {"kind": "kill", "cluster": "slow", "t": t0 + 0.5, "stopped_t": t0 + 0.5, "back_t": t0 + 0.6, "partial": {}},
        {"kind": "preempt", "cluster": "slow", "t": t0 + 2.0, "stopped_t": t0 + 2.2, "back_t": t0 + 2.5,
         "partial": {}},
    ]  # fmt: skip
    processes = [{"cluster": "slow", "start": t0 + 0.8}, {"cluster": "slow", "start": t0 + 3.0}]
    meta = {
        "policy": "cost", "window_s": window, "created_at": t0, "events": events, "processes": processes,
        "engine_commands": {"slow": ["fleetbatch", "engine", "serve", "--lease-s", "1.5", "--checkpoint-tokens=8"]},
        "gateway_args": ["--spot-margin=0.7"],
    }  # fmt: skip
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "meta.json").write_text(json.dumps({**meta, "completed_at": t0 + 1, "cost_dollars": 1.0}))
    sim, _ = read_spot_run(run)
    result = sim.run()
    truth = {"cost_dollars": result.cost_dollars, "makespan_s": result.makespan_s, "outages": sim.outages,
             "market": sim.market}  # fmt: skip
    meta.update(completed_at=t0 + result.makespan_s, cost_dollars=result.cost_dollars)
    (run / "meta.json").write_text(json.dumps(meta))
    return str(run), truth


def test_a_loadgen_spot_run_is_replayed_with_its_events_prices_and_engine_options(tmp_path, capsys):
    run, truth = spot_run(tmp_path)
    got = [
        (o.cluster, o.kind, round(o.t, 6), round(o.notice_s, 6), round(o.back_t, 6)) for o in truth["outages"]
    ]
    # each back at its next engine's first heartbeat; the notice as long as the engine took to stop
    assert got == [("slow", "kill", 0.5, 0.0, 0.8), ("slow", "preempt", 2.0, 0.2, 3.0)]
    market = truth["market"]
    assert market.lease_s == 1.5 and market.checkpoint_tokens == 8 and market.window_s == 30.0
    assert market.spot_margin == 0.7 and sim_policy_margin(run) == 0.7  # the gateway's --spot-margin
    assert market.spot == {"slow"} and market.prices["fast"] > market.prices["slow"] > 0  # the catalog's
    out = replay([run])
    assert out["sim_cost_error"] == 0 and out["sim_makespan_error"] == 0
    assert out["runs"][0]["sim_cost_dollars"] == round(truth["cost_dollars"], 5) > 0
    assert main(["spot-replay", run]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["sim_cost_error"] == 0 and len(last["runs"]) == 1


def test_a_run_that_never_completed_is_refused(tmp_path):
    run, _ = spot_run(tmp_path)
    meta = json.loads((tmp_path / "cost_loose" / "meta.json").read_text())
    meta["completed_at"] = 0
    (tmp_path / "cost_loose" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="never completed"):
        replay([run])


def test_the_synthetic_preemption_process():
    out = preemptions(["a", "b"], 3600.0, 10.0, 30.0, 60.0, 0.5, seed=3)
    assert out == sorted(out, key=lambda o: (o.t, o.cluster)) and {o.cluster for o in out} == {"a", "b"}
    assert {o.kind for o in out} == {"kill", "preempt"} and all(o.t < 3600 for o in out)
    for name in ("a", "b"):  # a cluster is not preempted again before it is back
        mine = [o for o in out if o.cluster == name]
        assert all(nxt.t >= cur.back_t for cur, nxt in zip(mine, mine[1:], strict=False))
    assert preemptions(["a"], 3600.0, 0.0, 30.0, 60.0, 0.2, seed=0) == []
    with pytest.raises(ValueError):
        preemptions(["a"], 3600.0, 1.0, 30.0, 60.0, 1.5, seed=0)


def test_spot_scale_runs_both_and_times_them(capsys):
    argv = ["spot-scale", "--num-clusters", "6", "-n", "600", "--repeats", "1", "--preempts-per-hour", "3000",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["outages"] > 0 and out["spot_clusters"] == 4 and out["spot_cost_dollars"] > 0
    assert out["sim_cpu_seconds"] > 0 and out["sim_cpu_seconds_plain"] > 0 and out["sim_cpu_ratio"] > 0
