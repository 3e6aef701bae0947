"""The settings of ``fleetbatch loadgen chaos``: the fault kinds in the order they fire, :class:`ChaosConfig`,
and the command line that fills it.

``--wan-delay-ms`` (and ``--wan-jitter-ms``) put every engine behind its own TCP proxy to Redis
with that one-way delay on both directions (a round trip costs twice it), as for clusters in
other clouds; the partition cuts the first engine's proxy, the delay stays on it after the heal.
With neither, only the first engine goes through a proxy (the partition's), without delay."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from load.tcp_proxy import MODES

# in the order they fire; the cluster removal goes last
FAULTS = (
    "kill_engine",
    "stop_engine",
    "kill_redis",
    "redis_outage",
    "partition",
    "racing_movers",
    "kv_exhaust",
    "unwritable_store",
    "restart_in_intake",
    "kill_gateway",
    "reply_lost_engine",
    "reply_lost_gateway",
    "large_cancel",
    "redis_slow",
    "remove_sole_cluster",
)


@dataclass
class ChaosConfig:
    run_dir: Path
    queries: int = 1000
    size: str = "nano"
    max_tokens: int = 48
    lease_s: float = 15.0  # the engines' default
    stop_s: float = 0.0  # SIGSTOP length (0: twice the lease + 2 s)
    outage_s: float = 0.0  # Redis outage (0: twice the lease + 2 s)
    partition_s: float = 60.0
    partition_mode: str = "blackhole"  # or "reset" (load.tcp_proxy)
    wan_delay_ms: float = 0.0  # one-way delay of every engine's link to Redis (> 0: all behind proxies)
    wan_jitter_ms: float = 0.0  # plus U(0, jitter) per chunk (> 0: all behind proxies)
    store_s: float = 10.0  # the file store stays unwritable this long after the finalizer's first failure
    settle_s: float = 120.0  # bound of every wait for batches to finish
    restart_timeout_s: float = 300.0  # bound of the wait for a killed engine to be back
    intake_rows: int = 200  # the batch in background intake (and the intake threshold)
    large_cancel_rows: int = 100_000  # the batch large_cancel writes to the queues' head and cancels
    # the goal on redis_max_blocked_ms (None: reported, not judged: a time, which a loaded machine stretches)
    blocked_goal_ms: float | None = 50.0
    fire_at: float = 0.3  # fault k fires once this share of wave k has results
    progress_timeout_s: float = 600.0  # a wave without that progress this long ends the run
    seed: int = 0
    slowdown: float = 3.0  # every engine sleeps this x its compute per step
    engine_args: list[str] = field(default_factory=lambda: ["--max-running", "4"])
    faults: tuple[str, ...] = FAULTS

    @property
    def wan(self) -> bool:
        """Every engine behind its own delayed proxy (the multi-cloud case)."""
        return self.wan_delay_ms > 0 or self.wan_jitter_ms > 0

    def __post_init__(self) -> None:
        self.stop_s = self.stop_s or 2 * self.lease_s + 2
        self.outage_s = self.outage_s or 2 * self.lease_s + 2
        if self.outage_s < 2 * self.lease_s:
            raise ValueError(f"the Redis outage ({self.outage_s:g} s) must last at least twice the lease")
        for name in ("wan_delay_ms", "wan_jitter_ms", "partition_s"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0")
        if self.partition_mode not in MODES:
            raise ValueError(f"--partition-mode must be one of {', '.join(MODES)}")
        if self.queries < len(self.faults) + 1:
            raise ValueError(
                f"--num-queries must be at least {len(self.faults) + 1}: one wave per fault, plus one"
            )


def add_arguments(p) -> None:
    p.add_argument(
        "--num-queries",
        "-n",
        type=int,
        default=1000,
        help="generated queries, cut into one wave per fault + 1",
    )
    p.add_argument("--slowdown", type=float, default=3.0, help="engines sleep this x their compute per step")
    p.add_argument("--size", default="nano", help="size of the random local model")
    p.add_argument("--max-tokens", type=int, default=48, help="longest forced response")
    p.add_argument("--lease-s", type=float, default=15.0, help="query lease of the engines")
    p.add_argument(
        "--stop-s", type=float, default=0.0, help="SIGSTOP length (default: twice the lease + 2 s)"
    )
    p.add_argument(
        "--outage-s", type=float, default=0.0, help="Redis outage (default: twice the lease + 2 s)"
    )
    p.add_argument("--partition-s", type=float, default=60.0, help="engine <-> Redis partition length")
    p.add_argument(
        "--partition-mode",
        choices=MODES,
        default="blackhole",
        help="blackhole: packets vanish, reads hang until the heal; reset: connections reset, connects refused",
    )
    p.add_argument(
        "--wan-delay-ms",
        type=float,
        default=0.0,
        help="one-way delay (ms, each direction) between every engine and Redis: each engine gets its "
        "own proxy, as clusters in other clouds (0: only the partitioned engine's proxy, no delay)",
    )
    p.add_argument(
        "--wan-jitter-ms", type=float, default=0.0, help="plus a uniform 0..this ms per chunk (order kept)"
    )
    p.add_argument(
        "--store-s", type=float, default=10.0, help="file store unwritable this long after a finalize failed"
    )
    p.add_argument("--intake-rows", type=int, default=200, help="rows of the batch in background intake")
    p.add_argument(
        "--large-cancel-rows",
        type=int,
        default=100_000,
        help="rows of the batch large_cancel queues at the head of the queues, then cancels",
    )
    p.add_argument(
        "--fire-at", type=float, default=0.3, help="fault k fires once this share of wave k is done"
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=120.0,
        help="after the last fault healed, a query not final by then is stuck",
    )
    p.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated subset of {', '.join(FAULTS)}"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/chaos", help="Redis data, files and process logs")


def config_from_args(args) -> ChaosConfig:
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    return ChaosConfig(
        run_dir=Path(args.run_dir).resolve(),
        queries=args.num_queries,
        size=args.size,
        max_tokens=args.max_tokens,
        lease_s=args.lease_s,
        stop_s=args.stop_s,
        outage_s=args.outage_s,
        partition_s=args.partition_s,
        partition_mode=args.partition_mode,
        wan_delay_ms=args.wan_delay_ms,
        wan_jitter_ms=args.wan_jitter_ms,
        store_s=args.store_s,
        intake_rows=args.intake_rows,
        large_cancel_rows=args.large_cancel_rows,
        fire_at=args.fire_at,
        slowdown=args.slowdown,
        settle_s=args.settle_s,
        seed=args.seed,
        faults=tuple(f for f in FAULTS if f in faults),  # always in the order of FAULTS
    )
