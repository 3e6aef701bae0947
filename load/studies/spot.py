"""``fleetbatch loadgen spot``: one workload on a fleet with spot clusters that are preempted and killed, under
``--policy cost`` and ``--policy token``, against the same fleet all on demand and left alone.

The fleet is the planned default one (``fleetbatch gateway up --clusters`` plans each cluster's devices and
runs its engine on cost-model devices): ``fast`` = 2 x A100-40G on demand, ``medium`` = V100-32G + T4 and
``slow`` = 2 x T4, both on ``market: spot`` (the catalog's prices, spot at 30 %). The workload: the
``--num-queries`` queries of the mixed dataset with their recorded lengths (capped at ``--max-tokens``),
one batch. Setups, one ``fleetbatch gateway up`` each:

* ``on_demand`` (c): ``--policy token``, every cluster on demand, no event. Run first: its makespan
  ``T`` sets the windows (``--windows``: ``loose`` = 2 T, ``tight`` = 1.2 T, ``wide`` = 4 T);
* per window, ``cost`` (a): ``--policy cost`` on the spot fleet, and ``token`` (b): ``--policy token`` on the
  spot fleet, the batch submitted with that completion window and the same events fired by progress
  (:mod:`load.studies.spot_events`): a SIGKILL of ``slow``'s engine (``--kill-at``), and at each share of
  ``--preempt-at`` a notice of ``--notice`` seconds to each spot cluster (shorter than a query's decode
  time here, so running queries are checkpointed and resumed elsewhere), each back ``--back-after`` s
  after its engine stopped (``rebalance --add C --update``, its engine started again).

The batch's cost is the gateway's cost meter (``GetBatch``'s ``cost_dollars``: :mod:`gateway.assign.cost`'s
billing model). The last line is one JSON object (:mod:`load.studies.spot_stats`): ``cost_vs_token_same_fleet``
(a / b) and ``cost_vs_on_demand`` (a / c) per window, ``deadlines_met``, ``preempted_running_queries``,
``recomputed_tokens_per_preempted_query``, ``lost``, ``duplicated``, each run's figures, and the simulator's
replay of every run (``fleetbatch sim spot-replay``, :mod:`sim.spot_replay`, in a process of its own: the
simulator imports this package, not the reverse): ``sim_cost_error`` and ``sim_makespan_error``, the mean
relative errors of its cost and makespan over the runs; and per window the least any split could have cost
with what the runs measured (:mod:`load.studies.spot_floor`): ``cost_floor_vs_token_same_fleet`` and
``cost_floor_vs_on_demand`` (``_tight`` for the tight window), the bounds below which no split of this fleet's
work within the policy's margin goes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm import tqdm

from clusterfile import dump_cluster_file, load_cluster_file
from gateway.assign.cost import fleet_prices
from gateway.grpc_api.auth import deployment_token
from gateway.grpc_api.tls import channel
from load.client import result_row, to_request
from load.deployment import LocalDeployment
from load.reports.runrecord import META, RESULTS, read_jsonl, write_run
from load.studies.spot_events import Event, HeartbeatLog, SpotEvents
from load.studies.spot_stats import summarise
from load.studies.study import sim_cli, workload
from load.workload import WorkItem
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc

FLEET = (("fast", ["A100-40G", "A100-40G"], "on-demand"), ("medium", ["V100-32G", "T4"], "spot"),
         ("slow", ["T4", "T4"], "spot"))  # fmt: skip
WINDOWS = {"loose": 2.0, "tight": 1.2, "wide": 4.0}  # multiples of the on-demand run's makespan
POLL_S = 0.3


def add_arguments(p) -> None:
    p.add_argument("--num-queries", "-n", type=int, default=300, help="queries of the batch")
    p.add_argument(
        "--dataset", default="mixed", help="real workload with recorded lengths ('' for the generated mix)"
    )
    p.add_argument("--max-tokens", type=int, default=96, help="cap on the recorded response lengths")
    p.add_argument("--windows", default="loose,tight", help=f"comma-separated, of {', '.join(WINDOWS)}")
    p.add_argument(
        "--min-window-s",
        type=float,
        default=0.0,
        help="the shortest window, in seconds (a tiny run's few seconds leave no room for a killed engine's lease "
        "and restart; default 0: the multiples of T alone)",
    )
    p.add_argument("--notice", type=float, default=2.0, help="seconds of each preemption notice")
    p.add_argument(
        "--preempt-at",
        default="0.2,0.5",
        help="shares of the rows done at which each spot cluster gets a notice",
    )
    p.add_argument(
        "--kill-at",
        type=float,
        default=0.1,
        help="share of the rows done at which slow's engine is SIGKILLed (<0: never)",
    )
    p.add_argument(
        "--back-after",
        type=float,
        default=6.0,
        help="seconds from a preempted engine's stop until its cluster is back",
    )
    p.add_argument(
        "--reuse-on-demand",
        default=None,
        metavar="DIR",
        help="take run (c) from this on_demand run directory of an earlier run of the same workload (not run again)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/spot", help="one run directory per setup")
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="extra `fleetbatch gateway up` argument (repeatable)",
    )
    p.add_argument("--no-plots", action="store_true", help="no PNG of each run's cost and finish per cluster")
    p.add_argument(
        "--no-replay", action="store_true", help="no simulator replay of the runs (sim_cost_error: null)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def events(args) -> list[Event]:
    out = [Event(args.kill_at, "kill", "slow")] if args.kill_at >= 0 else []
    for share in (float(x) for x in args.preempt_at.split(",") if x.strip()):
        out += [Event(share, "preempt", name) for name, _, market in FLEET if market == "spot"]
    return out


def fleet_file(path: Path, spot: bool) -> Path:
    rows = [{"name": n, "devices": d, "market": m if spot else "on-demand"} for n, d, m in FLEET]
    dump_cluster_file(path, rows)
    return path


def _costs(stub) -> dict:
    resp = stub.ListClusters(pb.ListClustersRequest(), timeout=30)
    return {"t": time.time(), "fleet": resp.cost_dollars,
            "clusters": {c.name: c.cost_dollars for c in resp.clusters}}  # fmt: skip


def run_setup(
    name: str, policy: str, spot: bool, items: list[WorkItem], window_s: float | None, out: Path, args
) -> dict:
    """One ``fleetbatch gateway up``: the batch submitted, the events fired by its progress, read until final."""
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    clusters = fleet_file(run_dir / "clusters.yaml", spot)
    up = ["--clusters", str(clusters), "--policy", policy, "--http-port", "-1", *args.gateway_arg]
    plan = events(args) if spot else []
    costs: list[dict] = []
    bar = tqdm(total=len(items), desc=f"spot {name}", unit="row", disable=args.no_progress)
    with LocalDeployment(run_dir / "deploy", up) as info:
        ev = SpotEvents(info, run_dir, plan, args.notice, args.back_after)
        with (
            channel(info["address"], token=deployment_token(info)) as ch,
            channel(info["address"], token="") as admin_ch,
            HeartbeatLog(info["redis_url"], list(info["clusters"])) as beats,
        ):
            stub = pb_grpc.BatchServiceStub(ch)
            ev.attach(pb_grpc.AdminServiceStub(admin_ch))
            req = to_request(items, f"spot-{name}")
            if window_s is not None:
                req.completion_window = f"{max(1, round(window_s))}s"
            batch_id = stub.SubmitBatch(req, timeout=600).id
            give_up = time.monotonic() + 3600
            while True:
                b = stub.GetBatch(pb.GetBatchRequest(batch_id=batch_id), timeout=30)
                done = b.request_counts.completed + b.request_counts.failed
                bar.update(done - bar.n)
                ev.progress(done / max(1, len(items)))
                costs.append(_costs(stub))
                if b.completed_at > 0 or time.monotonic() > give_up:
                    break
                time.sleep(POLL_S)
            ev.join()
            time.sleep(1.0)  # the engines' last heartbeats carry their final counts
            costs.append(_costs(stub))
            stream = stub.StreamResults(pb.StreamResultsRequest(batch_id=batch_id), timeout=600)
            rows = [result_row(r) for r in stream]
    bar.close()
    meta = {
        "batch_id": batch_id, "policy": policy, "spot": spot, "window_s": window_s, "backend": "native",
        "created_at": b.created_at, "completed_at": b.completed_at, "deadline": b.deadline,
        "status": pb.BatchStatus.Name(b.status), "cost_dollars": b.cost_dollars,
        "queries_per_cluster": dict(b.queries_per_cluster),
        "events": [{"kind": s.event.kind, "cluster": s.event.cluster, "at": s.event.at, "t": s.t,
                    "stopped_t": s.stopped_t, "back_t": s.back_t, "running": s.running, "partial": s.partial}
                   for s in ev.seen],
        "processes": beats.processes(),
        "engine_commands": ev.commands,  # their --lease-s and --checkpoint-tokens, for the simulator's replay
        "gateway_args": list(args.gateway_arg),  # its --spot-margin, for the replay
    }  # fmt: skip
    write_run(run_dir, rows, meta)
    (run_dir / "costs.jsonl").write_text("".join(json.dumps(c) + "\n" for c in costs))
    return {"name": name, "rows": rows, "meta": meta, "costs": costs, "total": len(items)}


def load_setup(run_dir: Path, total: int) -> dict:
    """A run written by :func:`run_setup` earlier, as it returned it."""
    meta = json.loads((run_dir / META).read_text())
    return {"name": run_dir.name, "rows": read_jsonl(run_dir / RESULTS), "meta": meta,
            "costs": read_jsonl(run_dir / "costs.jsonl"), "total": total}  # fmt: skip


def run(args) -> dict:
    windows = [w.strip() for w in args.windows.split(",") if w.strip()]
    if not windows or any(w not in WINDOWS for w in windows):
        raise ValueError(f"--windows: of {', '.join(WINDOWS)}, not {args.windows!r}")
    out = Path(args.out)
    items = workload(args)
    if args.reuse_on_demand:
        runs = {"on_demand": load_setup(Path(args.reuse_on_demand), len(items))}
    else:
        runs = {"on_demand": run_setup("on_demand", "token", False, items, None, out, args)}
    dirs = {"on_demand": Path(args.reuse_on_demand) if args.reuse_on_demand else out / "on_demand"}
    makespan = runs["on_demand"]["meta"]["completed_at"] - runs["on_demand"]["meta"]["created_at"]
    window_s = {w: max(WINDOWS[w] * makespan, args.min_window_s) for w in windows}
    print(f"on demand, token policy: makespan T = {makespan:.1f} s; windows "
          + ", ".join(f"{w} {window_s[w]:.0f} s" for w in windows))  # fmt: skip
    for w in windows:
        for policy in ("cost", "token"):
            runs[f"{policy}_{w}"] = run_setup(f"{policy}_{w}", policy, True, items, window_s[w], out, args)
            dirs[f"{policy}_{w}"] = out / f"{policy}_{w}"
    replayed = sim_cli("spot-replay", *map(str, dirs.values())) if not args.no_replay else {}
    spot_fleet = load_cluster_file(dirs[f"cost_{windows[0]}"] / "clusters.yaml").clusters
    result = summarise(runs, windows, replayed, fleet_prices(spot_fleet))
    result.update(queries=len(items), max_tokens=args.max_tokens, notice_s=args.notice, out=str(out),
                  on_demand_makespan_s=round(makespan, 2))  # fmt: skip
    if not args.no_plots:
        from load.studies.spot_plot import plot

        result["plot"] = str(plot(runs, out / "spot.png"))
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    return result
