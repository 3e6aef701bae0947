"""``fleetbatch loadgen wan``: the same batch on the same emulated devices, with every engine across a slow link to Redis.

Each one-way delay of ``--delays-ms`` (default 0, 10, 25, 50 and 100 ms: round trips of 0 to
200 ms) is its own real ``fleetbatch gateway up`` on the cost-model devices of ``fleetbatch loadgen study``
(``--step-cost``, three equal clusters or ``--step-times 1,2,4``, token policy, offloading off). The
harness starts the embedded Redis itself and puts a latency proxy (:mod:`load.tcp_proxy`) between
EVERY cluster's engine and it: each cluster's ``redis_url`` in ``clusters.yaml`` points at its
own proxy, which holds every chunk ``delay + U(0, --jitter-ms)`` in each direction. The gateway
and the run's sampler talk to Redis directly: only the engines are across the WAN.

What it reports, per round-trip time (RTT = 2 x the one-way delay, the JSON's keys in ms):
each cluster's device-busy fraction (seconds its engine spent in steps, from its heartbeats,
over its span from first claim to last finish; :mod:`load.studies.wan_stats`), their mean, the
makespan and its ratio to the 0 ms run, and Redis round trips per engine step. The last line
of stdout is one JSON object with ``utilization_by_rtt_ms``, ``utilization_by_cluster``,
``makespan_by_rtt_ms``, ``makespan_ratio_at_100ms`` (makespan at 100 ms RTT, i.e. 50 ms one
way, over the one at 0 ms), ``utilization_at_100ms`` (mean device-busy fraction at 100 ms RTT
over the one at 0 ms) and ``redis_round_trips_per_step``; ratios need a 0 ms and a 50 ms run
and are null otherwise. ``utilization_vs_rtt.png`` in ``--out`` plots each cluster's busy
fraction and the makespan ratio against RTT; each run's directory (``--out/rttNms``) is one
that ``fleetbatch loadgen report`` reads. See docs/design/wan.md.
"""

from __future__ import annotations

import math
from pathlib import Path

from tqdm import tqdm

from clusterfile import dump_cluster_file
from engines.device import StepCost
from load.reports.report import build_report
from load.reports.runrecord import write_run
from load.studies.run import run_deployed
from load.studies.study import Setup, add_fleet_arguments, fleet_yaml, workload
from load.studies.wan_plot import draw
from load.studies.wan_stats import rtt_key, summarise
from load.tcp_proxy import Link, TcpProxy
from load.workload import WorkItem
from workqueue.embedded import EmbeddedRedis


def parse_numbers(text: str, what: str, positive: bool = False) -> list[float]:
    """``"0,10,25"`` -> ``[0.0, 10.0, 25.0]``; a clear ValueError for anything else."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: comma-separated numbers, not {text!r}") from None
    if not values or any(not math.isfinite(v) or v < 0 or (positive and v == 0) for v in values):
        raise ValueError(f"{what}: finite numbers {'> 0' if positive else '>= 0'}, not {text!r}")
    return values


def run_at(delay_ms: float, items: list[WorkItem], run_dir: Path, speeds: tuple[float, ...], args) -> None:
    """One deployment with every engine ``delay_ms`` away from Redis (each way); writes ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    redis = EmbeddedRedis(run_dir / "redis", persist=False)
    proxies: list[TcpProxy] = []
    try:
        fleet = fleet_yaml(Setup("wan", args.policy, "native", speeds), args)
        link = Link(delay_s=delay_ms / 1000.0, jitter_s=args.jitter_ms / 1000.0)
        for i, row in enumerate(fleet["clusters"]):
            proxy = TcpProxy(redis.socket_file, up=link, down=link, seed=args.seed + i).start()
            proxies.append(proxy)
            row["redis_url"] = f"redis://{proxy.address}/0"  # the engine's Redis: across the proxy
        dump_cluster_file(run_dir / "clusters.yaml", fleet["clusters"])
        up_args = ["--clusters", str(run_dir / "clusters.yaml"), "--policy", args.policy]
        up_args += ["--redis-url", redis.url, *([] if args.offload else ["--no-offload"]), *args.gateway_arg]
        _, batch_ids, rows = run_deployed(run_dir, up_args, items, f"wan-rtt{rtt_key(delay_ms)}")
        meta = {
            "batch_id": batch_ids[0],
            "policy": args.policy,
            "backend": "native",
            "fleet": list(speeds),
            "clusters": [r["name"] for r in fleet["clusters"]],
            "emulation": "cost",
            "device_cost_ms": args.step_cost,  # the speed-1 device; cluster i runs at 1 / fleet[i]
            "one_way_delay_ms": delay_ms,
            "rtt_ms": 2 * delay_ms,
            "jitter_ms": args.jitter_ms,
            "proxies": [p.stats() for p in proxies],
        }
        write_run(run_dir, rows, meta)
        build_report(run_dir, plots=False)  # report.json, as `fleetbatch loadgen report` writes it
    finally:
        for p in proxies:
            p.close()
        redis.close()


def run(args) -> dict:
    delays = parse_numbers(args.delays_ms, "--delays-ms")
    if len({rtt_key(d) for d in delays}) != len(delays):
        raise ValueError(f"--delays-ms: a delay appears twice in {args.delays_ms!r}")
    parse_numbers(str(args.jitter_ms), "--jitter-ms")
    if args.step_times:
        speeds = tuple(parse_numbers(args.step_times, "--step-times", positive=True))
    else:
        if args.num_clusters < 1:
            raise ValueError("--clusters must be >= 1")
        speeds = (1.0,) * args.num_clusters
    try:  # a bad cost model fails here, not in every engine
        StepCost.parse(args.step_cost)
    except ValueError as e:
        raise ValueError(f"--step-cost: {e}") from None
    items = workload(args)
    root = Path(args.out)
    runs: dict[str, Path] = {}
    bar = tqdm(total=len(delays), desc="wan", unit="run", disable=args.no_progress)
    for d in delays:
        rtt = rtt_key(d)
        bar.set_postfix_str(f"rtt {rtt} ms")
        runs[rtt] = root / f"rtt{rtt}ms"
        run_at(d, items, runs[rtt], speeds, args)
        bar.update(1)
    bar.close()
    out = summarise(runs)
    plot = draw(out, root, f"{len(items)} queries on {len(speeds)} clusters (speeds {fleet_text(speeds)})")
    print(format_table(out))
    out.update(
        delays_ms=delays,
        jitter_ms=args.jitter_ms,
        queries=len(items),
        fleet=list(speeds),
        batch=args.max_running,
        policy=args.policy,
        step_cost_ms=args.step_cost,
        span="cluster: its first claim to its last finish",
        plot=str(plot),
        out=str(root),
    )
    return out


def fleet_text(speeds: tuple[float, ...]) -> str:
    return ":".join(f"{s:g}" for s in speeds)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def format_table(s: dict) -> str:
    names = list(s["utilization_by_cluster"])
    head = f"{'RTT ms':>7} {'makespan s':>10} {'x 0 ms':>7} {'busy':>6} " + " ".join(f"{n:>6}" for n in names)
    lines = [head + f" {'RT/step':>8} {'busy from':>10}"]
    for rtt, m in s["makespan_by_rtt_ms"].items():
        ratio = s["makespan_ratio_by_rtt_ms"].get(rtt)
        per_step = s["redis_round_trips_per_step"].get(rtt)
        cells = " ".join(f"{_pct(s['utilization_by_cluster'][n].get(rtt)):>6}" for n in names)
        lines.append(
            f"{rtt:>7} {m:>10.1f} {'-' if ratio is None else f'{ratio:.3f}':>7} "
            f"{_pct(s['utilization_by_rtt_ms'][rtt]):>6} {cells} "
            f"{'-' if per_step is None else f'{per_step:.2f}':>8} "
            f"{','.join(s['busy_source_by_rtt_ms'][rtt]) or '-':>10}"
        )
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument(
        "--delays-ms",
        default="0,10,25,50,100",
        help="one-way delays engine <-> Redis, ms, comma-separated: one run each (round trip = 2 x delay; "
        "the ratios need 0 and 50)",
    )
    p.add_argument(
        "--jitter-ms", type=float, default=0.0, help="each chunk also waits U(0, this) ms, each way"
    )
    p.add_argument("--num-queries", "-n", type=int, default=300, help="queries in the batch")
    p.add_argument(
        "--dataset", default="mixed", help="real workload with forced lengths ('' for the generated mix)"
    )
    p.add_argument("--max-tokens", type=int, default=256, help="cap on forced response lengths")
    p.add_argument("--num-clusters", type=int, default=3, help="equal clusters (unless --step-times)")
    p.add_argument("--step-times", default="", help="relative step times per cluster instead, e.g. 1,2,4")
    p.add_argument("--policy", default="token", help="the gateway's assignment policy")
    p.add_argument("--offload", action="store_true", help="let the offloader move work (off by default)")
    add_fleet_arguments(p, "runs/wan", "one run directory per delay, and the plot")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(emulation="cost")  # what load.studies.study.fleet_yaml reads: the cost-model devices
