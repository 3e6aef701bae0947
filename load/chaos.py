"""``loadgen chaos``: one real deployment, eleven fault kinds injected while batches run, then the books.

The deployment: an embedded Redis (AOF, ``appendfsync everysec``), two gateway replicas
(both run offloaders, background intake and the OpenAI-compatible HTTP front on one shared
files directory), one engine process per cluster kept alive by
:class:`gateway.supervisor.EngineSupervisor` (as under ``gateway up``), the first cluster's
engine talking to Redis through a TCP proxy the harness controls (:mod:`load.tcp_proxy`), and
clients that stream with ``start_index`` and switch replica on errors (:mod:`load.chaos_client`).
The first cluster takes only small queries (``max_query_tokens``), the second any that fit its
KV cache (:mod:`load.chaos_load`).

**Faults follow progress, not the clock.** The load comes in waves, one per fault plus one:
fault ``k`` fires once ``--fire-at`` of wave ``k`` has results, and wave ``k + 1`` is submitted
only after fault ``k`` healed, so every kind fires on a fast machine and on a slow one. In order
(:mod:`load.chaos_faults`):

* ``kill_engine``: SIGKILL the engine holding the most leases; ``stop_engine``: SIGSTOP one past its lease.
* ``kill_redis``: SIGKILL Redis and restart it 1.5 s later on its data directory.
* ``redis_outage``: Redis down for ``--outage-s`` (at least twice the lease), then back.
* ``partition``: the proxy between the first cluster's engine and Redis cut for
  ``--partition-s`` (live connections dropped, new ones refused), then healed.
* ``racing_movers``: admin rebalances ``--apply`` on both replicas at once, with both offloaders.
* ``kv_exhaust``: rows longer than an engine's KV cache, over gRPC and in an OpenAI batch.
* ``unwritable_store``: every file write of the gateways fails while an OpenAI batch finalizes.
* ``restart_in_intake``: the engine of the only cluster that can take some rows is SIGKILLed
  while a large batch is in background intake.
* ``kill_gateway``: SIGKILL the replica a client streams from; restarted on the same ports.
* ``remove_sole_cluster``: the second cluster removed while its queue holds a row only it can take.

Then the books (:mod:`load.chaos_books`); the run fails (exit code 1) when a count there is
above 0 or fewer fault kinds fired than asked. ``recovery_s``: per fault, seconds from its heal
to the next result written (by the cluster it hit, for a fault on one engine).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
import yaml

from gateway.supervisor import EngineSupervisor
from gateway.up import default_clusters
from load.chaos_books import GrpcBatch, format_report, grpc_books, merged_counts, verdict
from load.chaos_client import ResilientClient
from load.chaos_faults import CLIENT_TOKEN, TOKEN, FaultsMixin
from load.chaos_load import KV_BUDGET, SMALL_LIMIT, waves
from load.chaos_openai import OpenAIBatches, OpenAIRun, user_view
from load.chaos_procs import GatewayProcess, RestartableRedis
from load.client import to_request
from load.tcp_proxy import TcpProxy
from load.workload import WorkItem
from workqueue import WorkQueue, connect
from workqueue.invariants import check

log = logging.getLogger(__name__)

# in the order they fire; the removed cluster stays removed, so that fault goes last
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
    store_s: float = 10.0  # the file store stays unwritable this long after the finalizer's first failure
    settle_s: float = 120.0  # bound of every wait for batches to finish
    restart_timeout_s: float = 300.0  # bound of the wait for a killed engine to be back
    intake_rows: int = 200  # the batch in background intake (and the intake threshold)
    fire_at: float = 0.3  # fault k fires once this share of wave k has results
    progress_timeout_s: float = 600.0  # a wave without that progress this long ends the run
    seed: int = 0
    slowdown: float = 3.0  # every engine sleeps this x its compute per step
    engine_args: list[str] = field(default_factory=lambda: ["--max-batch", "4"])
    faults: tuple[str, ...] = FAULTS

    def __post_init__(self) -> None:
        self.stop_s = self.stop_s or 2 * self.lease_s + 2
        self.outage_s = self.outage_s or 2 * self.lease_s + 2
        if self.outage_s < 2 * self.lease_s:
            raise ValueError(f"the Redis outage ({self.outage_s:g} s) must last at least twice the lease")
        if self.queries < len(self.faults) + 1:
            raise ValueError(f"--num must be at least {len(self.faults) + 1}: one wave per fault, plus one")


class Chaos(FaultsMixin):
    def __init__(self, config: ChaosConfig):
        self.c = config
        self.stop = threading.Event()
        self.injected: dict[str, int] = dict.fromkeys(FAULTS, 0)
        self.recovery_s: dict[str, float] = {}
        self.notes: dict[str, object] = {}
        self.restarts_observed = 0
        self.restarts_missed: list[str] = []
        self.affected: str | None = None
        self.redis: RestartableRedis | None = None
        self.proxy: TcpProxy | None = None
        self.gateways: list[GatewayProcess] = []
        self.engines: EngineSupervisor | None = None
        self.names: list[str] = []
        self.batches: list[GrpcBatch] = []
        self.clients: list[ResilientClient] = []
        self.openai: OpenAIBatches | None = None
        self.openai_runs: list[OpenAIRun] = []
        self.tag = secrets.token_hex(3)  # batch ids unique to this run (the Redis data dir may be reused)

    # ------------------------------------------------------------------ set-up

    def start(self) -> None:
        c = self.c
        logs = c.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.redis = RestartableRedis(c.run_dir / "redis")
        self.proxy = TcpProxy(self.redis.url.removeprefix("unix://")).start()
        specs = default_clusters(2, "native", c.size)
        self.names = [s.name for s in specs]
        for s in specs:
            s.engine_args += ["--lease-s", str(c.lease_s), "--slowdown", str(c.slowdown)]
            s.engine_args += ["--kv-budget-tokens", str(KV_BUDGET), *c.engine_args]
        specs[0].redis_url = f"redis://{self.proxy.address}/0"  # the partition cuts this one
        rows = [{"name": s.name, "capacity_tps": s.capacity_tps} for s in specs]
        rows[0]["max_query_tokens"] = SMALL_LIMIT
        clusters_file = c.run_dir / "clusters.yaml"
        clusters_file.write_text(yaml.safe_dump({"clusters": rows}))
        http_key = secrets.token_urlsafe(18)
        intake_env = {  # batches of intake_rows and more go through a slow background intake
            "FLEETBATCH_INTAKE_SYNC_MAX": str(c.intake_rows),
            "FLEETBATCH_INTAKE_CHUNK": "8",
            "FLEETBATCH_INTAKE_FIRST_CHUNK": "8",
            "FLEETBATCH_INTAKE_PAUSE_S": "0.5",
        }
        self.gateways = [
            GatewayProcess(
                n,
                self.redis.url,
                clusters_file,
                TOKEN,
                logs,
                files_dir=c.run_dir / "files",
                http_key=http_key,
                client_token=CLIENT_TOKEN,
                env=intake_env,
            )  # fmt: skip
            for n in ("a", "b")
        ]
        for g in self.gateways:
            g.start()
        self.openai = OpenAIBatches(self.gateways[0].http_url, http_key)
        self.engines = EngineSupervisor(specs, self.redis.url, logs, max_restarts=10)
        self.engines.start_all()
        if not self._wait(lambda: all(i.alive for i in self.queue().clusters(self.names)), 300):
            raise TimeoutError("engines sent no heartbeat within 300 s")

    def queue(self) -> WorkQueue:
        return WorkQueue(connect(self.redis.url))

    def close(self) -> None:
        self.stop.set()
        if self.engines is not None:
            for p in self.engines.procs.values():  # a stopped engine cannot act on SIGTERM
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)
            self.engines.stop()
        for g in self.gateways:
            g.stop()
        if self.proxy is not None:
            self.proxy.close()
        if self.redis is not None:
            self.redis.close()

    # ------------------------------------------------------------------ load and progress

    def submit(self, name: str, items: list[WorkItem]) -> str:
        """Submit a gRPC batch through a resilient client (its own thread); returns its id."""
        batch_id = f"chaos-{self.c.seed}-{self.tag}-{name}"
        client = ResilientClient(
            [g.address for g in self.gateways], to_request(items, batch_id), self.stop, CLIENT_TOKEN
        )
        self.clients.append(client)
        self.batches.append(GrpcBatch(name, batch_id, [it.id for it in items], client))
        client.start()
        return batch_id

    def openai_batch(self, name: str, items: list[WorkItem]) -> OpenAIRun:
        run = self.openai.create(name, items)
        self.openai_runs.append(run)
        return run

    def _results(self, batch_id: str) -> int:
        try:
            return self.queue().result_count(batch_id)
        except Exception:  # Redis down: progress unknown  # noqa: BLE001
            return -1

    def _progress(self, cluster: str | None) -> int:
        """Results written so far (by ``cluster``'s engine only, when given)."""
        if cluster is None:
            return sum(max(0, self._results(b.batch_id)) for b in self.batches)
        q = self.queue()
        return sum(1 for b in self.batches for r in q.results(b.batch_id) if r.get("cluster") == cluster)

    def _wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.engines.check()
            try:
                if predicate():
                    return True
            except (OSError, redis.RedisError):  # Redis down or restarting
                pass
            time.sleep(0.2)
        return False

    def _read(self, fn: Callable[[], int], default: int) -> int:
        """``fn()``, retried (bounded) while Redis is unreachable; ``default`` if it never answers."""
        box: list[int] = []
        self._wait(lambda: box.append(fn()) is None, 60)
        return box[0] if box else default

    def _batch_final(self, batch_id: str) -> bool:
        try:
            b = self.queue().batch(batch_id)
        except Exception:  # noqa: BLE001
            return False
        return b is not None and b.final

    # ------------------------------------------------------------------ the run

    def run(self) -> dict:
        c = self.c
        t0 = time.monotonic()
        load = waves(c.queries, len(c.faults) + 1, c.seed, c.max_tokens)
        wave = self.submit("w0", load[0])
        last_heal = time.monotonic()
        for k, fault in enumerate(c.faults):
            need = max(1, int(len(load[k]) * c.fire_at))
            if not self._wait(
                lambda w=wave, n=need: self._results(w) >= n or self._batch_final(w), c.progress_timeout_s
            ):
                log.error(
                    "chaos: wave %d made no progress in %.0f s; stopping before %s",
                    k,
                    c.progress_timeout_s,
                    fault,
                )
                break
            t_fault = time.monotonic()
            self.affected = None
            getattr(self, fault)()
            self.injected[fault] += 1
            last_heal = time.monotonic()
            before = self._read(lambda a=self.affected: self._progress(a), default=-1)
            wave = self.submit(f"w{k + 1}", load[k + 1])
            if self._wait(lambda b=before, a=self.affected: self._progress(a) > b, 120):
                self.recovery_s[fault] = round(time.monotonic() - last_heal, 2)
            self.notes.setdefault("fault_s", {})[fault] = round(last_heal - t_fault, 2)
        self._wait(
            lambda: all(self._batch_final(b.batch_id) for b in self.batches),
            max(0.0, last_heal + c.settle_s - time.monotonic()),
        )
        for run in self.openai_runs:
            self.openai.read(run, max(30.0, last_heal + c.settle_s - time.monotonic()))
        return self._books(time.monotonic() - t0)

    def _books(self, wall_s: float) -> dict:
        q = self.queue()
        self._wait(lambda: sum(i.inflight for i in q.clusters()) == 0, 30)
        g = grpc_books(q, self.batches)
        u = user_view(self.openai_runs)
        infos = q.clusters(self.names)
        report = {
            "faults": dict(self.injected),
            "queries": sum(len(b.ids) for b in self.batches) + sum(len(r.rows) for r in self.openai_runs),
            "lost": g["lost"],
            "duplicated": g["duplicated"],
            "stuck": g["stuck"],
            "invariant_violations": len(check(q.r)),
            "output_lines_missing": u["output_lines_missing"],
            "output_lines_duplicated": u["output_lines_duplicated"],
            "wrongly_failed": g["wrongly_failed_rows"] + u["wrongly_failed_lines"],
            "openai_violations": u["openai_violations"],
            "engines_not_restarted": len(self.restarts_missed),
            "engine_restarts": self.restarts_observed,
            "recovery_s": self.recovery_s,
            "wrongly_failed_examples": g["wrongly_failed_examples"],
            "openai_problems": u["openai_problems"],
            "notes": self.notes,
            "client_received": sum(len(cl.results) for cl in self.clients),
            "client_errors": merged_counts(cl.errors for cl in self.clients),
            "engines_alive": sum(i.alive for i in infos),
            "wall_s": round(wall_s, 1),
        }
        report["problems"] = verdict(report, self.c.faults)
        report["ok"] = not report["problems"]
        return report


def run_chaos(config: ChaosConfig) -> dict:
    chaos = Chaos(config)
    try:
        chaos.start()
        return chaos.run()
    finally:
        chaos.close()


def add_arguments(p) -> None:
    p.add_argument(
        "--num", "-n", type=int, default=1000, help="generated queries, cut into one wave per fault + 1"
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
        "--store-s", type=float, default=10.0, help="file store unwritable this long after a finalize failed"
    )
    p.add_argument("--intake-rows", type=int, default=200, help="rows of the batch in background intake")
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


def run(args) -> dict:
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    config = ChaosConfig(
        run_dir=Path(args.run_dir).resolve(),
        queries=args.num,
        size=args.size,
        max_tokens=args.max_tokens,
        lease_s=args.lease_s,
        stop_s=args.stop_s,
        outage_s=args.outage_s,
        partition_s=args.partition_s,
        store_s=args.store_s,
        intake_rows=args.intake_rows,
        fire_at=args.fire_at,
        slowdown=args.slowdown,
        settle_s=args.settle_s,
        seed=args.seed,
        faults=tuple(f for f in FAULTS if f in faults),  # always in the order of FAULTS
    )
    report = run_chaos(config)
    print(format_report(report, FAULTS), flush=True)
    return report
