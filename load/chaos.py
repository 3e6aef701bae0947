"""``loadgen chaos``: one real deployment, every fault kind injected while a batch runs, then the books.

The deployment: an embedded Redis (AOF, ``appendfsync everysec``), two gateway replicas
(both run offloaders), one engine process per cluster kept alive by
:class:`gateway.supervisor.EngineSupervisor` (as under ``gateway up``) and a client that
streams with ``start_index`` and switches replica on errors (:mod:`load.chaos_client`).

Faults fire in turn as the batch progresses (each after the previous one healed):

* ``kill_engine``: SIGKILL the engine holding the most leases; the supervisor restarts it.
* ``stop_engine``: SIGSTOP an engine past its lease, then SIGCONT: its leases lapse, its
  queries run elsewhere, and its late completions must not count twice (R1 live).
* ``kill_redis``: SIGKILL Redis and restart it on its data directory; engines and gateways
  reconnect by themselves. With ``appendfsync everysec`` an acknowledged write may be lost
  if Redis dies within a second of it: a lost result is re-run (its lease or queue entry
  is restored with it), a lost submit would be repeated by the idempotent client.
* ``racing_movers``: admin rebalance ``--apply`` on both replicas at once, repeatedly,
  while both offloaders run (one mover at a time, by the mover lease).
* ``kill_gateway``: SIGKILL the gateway replica the client streams from; it is restarted on
  the same port (as a process manager would) and the client resumes with ``start_index``.

Then: ``lost`` (queries without a result), ``duplicated`` (result rows beyond one per
query, in Redis), ``stuck`` (queries not final ``settle_s`` after the last fault healed)
and ``invariant_violations`` (:func:`workqueue.invariants.check` on the quiet queue).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
import yaml

from gateway.supervisor import EngineSupervisor
from gateway.up import default_clusters
from load.chaos_client import ResilientClient
from load.chaos_procs import GatewayProcess, RestartableRedis
from load.client import to_request
from load.workload import generated
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from workqueue import WorkQueue, connect
from workqueue.invariants import check

log = logging.getLogger(__name__)

# in the order they fire; the gateway restart goes last (a slow restart must not let the batch
# finish before the other faults had their turn)
FAULTS = ("kill_engine", "stop_engine", "kill_redis", "racing_movers", "kill_gateway")
TOKEN = "chaos-admin-token"


@dataclass
class ChaosConfig:
    run_dir: Path
    queries: int = 1000
    clusters: int = 2
    size: str = "nano"
    max_tokens: int = 48
    lease_s: float = 3.0
    settle_s: float = 60.0
    seed: int = 0
    slowdown: float = 3.0  # every engine sleeps this x its compute per step: a batch long enough to break
    engine_args: list[str] = field(default_factory=lambda: ["--max-batch", "4"])
    faults: tuple[str, ...] = FAULTS


class Chaos:
    def __init__(self, config: ChaosConfig):
        self.c = config
        self.stop = threading.Event()
        self.injected: dict[str, int] = dict.fromkeys(FAULTS, 0)
        self.recovery_s: dict[str, float] = {}
        self.redis: RestartableRedis | None = None
        self.gateways: list[GatewayProcess] = []
        self.engines: EngineSupervisor | None = None
        self.client: ResilientClient | None = None

    # ------------------------------------------------------------------ set-up

    def start(self) -> None:
        c = self.c
        logs = c.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.redis = RestartableRedis(c.run_dir / "redis")
        specs = default_clusters(c.clusters, "native", c.size)
        for s in specs:
            s.engine_args += ["--lease-s", str(c.lease_s), "--slowdown", str(c.slowdown), *c.engine_args]
        clusters_file = c.run_dir / "clusters.yaml"
        clusters_file.write_text(
            yaml.safe_dump({"clusters": [{"name": s.name, "capacity_tps": s.capacity_tps} for s in specs]})
        )
        self.gateways = [GatewayProcess(n, self.redis.url, clusters_file, TOKEN, logs) for n in ("a", "b")]
        for g in self.gateways:
            g.start()
        self.engines = EngineSupervisor(specs, self.redis.url, logs, max_restarts=10)
        self.engines.start_all()
        q = self.queue()
        deadline = time.monotonic() + 300
        while not all(i.alive for i in q.clusters([s.name for s in specs])):
            if time.monotonic() > deadline:
                raise TimeoutError("engines sent no heartbeat within 300 s")
            self.engines.check()
            time.sleep(0.2)

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
        if self.redis is not None:
            self.redis.close()

    # ------------------------------------------------------------------ helpers

    def _results(self, batch_id: str) -> int:
        try:
            return self.queue().result_count(batch_id)
        except Exception:  # Redis down: progress unknown  # noqa: BLE001
            return -1

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

    def _recovered(self, fault: str, batch_id: str, t_fault: float) -> None:
        """Recovery time: from the fault to the first result written after it healed."""
        before = self._results(batch_id)
        if self._wait(lambda: self._results(batch_id) > before >= 0 or self._batch_final(batch_id), 120):
            self.recovery_s[fault] = round(time.monotonic() - t_fault, 2)

    def _batch_final(self, batch_id: str) -> bool:
        try:
            b = self.queue().batch(batch_id)
        except Exception:  # noqa: BLE001
            return False
        return b is not None and b.final

    # ------------------------------------------------------------------ faults

    def _busiest_engine(self) -> str:
        """The running engine (process up, heartbeat live) holding the most leases."""
        infos = [i for i in self.queue().clusters() if i.alive and self.engines.procs[i.name].poll() is None]
        return max(infos, key=lambda i: i.inflight).name

    def _all_engines_back(self, since: float) -> bool:
        return all(p.poll() is None for p in self.engines.procs.values()) and all(
            i.alive and i.last_heartbeat > since for i in self.queue().clusters()
        )

    def kill_engine(self) -> None:
        name = self._busiest_engine()
        os.kill(self.engines.procs[name].pid, signal.SIGKILL)
        log.warning("chaos: SIGKILL engine %s", name)
        killed_at = time.time()
        self._wait(lambda: self._all_engines_back(killed_at), 300)

    def stop_engine(self) -> None:
        name = self._busiest_engine()
        pid = self.engines.procs[name].pid
        pause = 2 * self.c.lease_s + 2
        os.kill(pid, signal.SIGSTOP)
        log.warning("chaos: SIGSTOP engine %s for %.1f s (lease %.1f s)", name, pause, self.c.lease_s)
        time.sleep(pause)
        os.kill(pid, signal.SIGCONT)
        log.warning("chaos: SIGCONT engine %s", name)
        resumed_at = time.time()
        self._wait(lambda: self._all_engines_back(resumed_at), 120)

    def kill_gateway(self) -> None:
        """SIGKILL the replica the client is streaming from, then restart it on its port."""
        g = next(g for g in self.gateways if g.address == self.client.target)
        g.kill()
        log.warning("chaos: SIGKILL gateway %s", g.name)
        time.sleep(1.0)
        g.start()

    def kill_redis(self) -> None:
        self.redis.kill()
        log.warning("chaos: SIGKILL Redis")
        time.sleep(1.5)
        self.redis.restart()
        log.warning("chaos: Redis restarted")
        back = time.time()
        self._wait(lambda: self._all_engines_back(back), 120)

    def racing_movers(self) -> None:
        def rebalance(target: str) -> None:
            with grpc.insecure_channel(target) as ch:
                admin = pb_grpc.AdminServiceStub(ch)
                for _ in range(5):
                    try:
                        admin.Rebalance(
                            pb.RebalanceRequest(dry_run=False),
                            metadata=[("authorization", f"Bearer {TOKEN}")],
                            timeout=30,
                        )
                    except grpc.RpcError as e:
                        log.info("chaos: rebalance on %s: %s", target, e.code().name)

        threads = [
            threading.Thread(target=rebalance, args=(g.address,)) for g in self.gateways for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        log.warning("chaos: %d admin rebalances raced with two offloaders", 5 * len(threads))

    # ------------------------------------------------------------------ the run

    def run(self) -> dict:
        c = self.c
        t0 = time.monotonic()
        batch_id = f"chaos-{c.seed}"
        items = generated(c.queries, seed=c.seed, max_tokens=c.max_tokens)
        client = self.client = ResilientClient(
            [g.address for g in self.gateways], to_request(items, batch_id), self.stop
        )
        thread = client.start()
        last_heal = time.monotonic()
        for k, fault in enumerate(c.faults):
            at = int(c.queries * (0.03 + 0.06 * k))  # progress at which this fault fires
            if not self._wait(
                lambda at=at: self._results(batch_id) >= at or self._batch_final(batch_id), 600
            ):
                break
            if self._batch_final(batch_id):
                log.warning("chaos: the batch finished before fault %s", fault)
                break
            t_fault = time.monotonic()
            getattr(self, fault)()
            self.injected[fault] += 1
            last_heal = time.monotonic()
            self._recovered(fault, batch_id, t_fault)
        self._wait(lambda: self._batch_final(batch_id), max(0.0, last_heal + c.settle_s - time.monotonic()))
        thread.join(timeout=max(1.0, last_heal + c.settle_s - time.monotonic()))
        return self._books(batch_id, client, time.monotonic() - t0)

    def _books(self, batch_id: str, client: ResilientClient, wall_s: float) -> dict:
        q = self.queue()
        b = q.batch(batch_id)
        rows = q.results(batch_id)
        ids = {r["query_id"] for r in rows}
        finished = (b.completed + b.failed + b.cancelled) if b else 0
        self._wait(lambda: sum(i.inflight for i in q.clusters()) == 0, 30)
        infos = q.clusters()
        return {
            "faults": dict(self.injected),
            "queries": self.c.queries,
            "lost": self.c.queries - len(ids & set(client.results))
            if client.final
            else self.c.queries - len(ids),
            "duplicated": len(rows) - len(ids),
            "stuck": self.c.queries - finished,
            "invariant_violations": len(check(q.r)),
            "failed": b.failed if b else 0,
            "client_received": len(client.results),
            "client_duplicates_dropped": client.duplicates_dropped,
            "client_rereads": client.rereads,
            "client_resubmits": client.resubmits,
            "client_errors": client.errors,
            "engines_alive": sum(i.alive for i in infos),
            "engine_restarts": sum(self.engines.restarts.values()),
            "recovery_s": self.recovery_s,
            "wall_s": round(wall_s, 1),
        }


def run_chaos(config: ChaosConfig) -> dict:
    chaos = Chaos(config)
    try:
        chaos.start()
        return chaos.run()
    finally:
        chaos.close()


def add_arguments(p) -> None:
    p.add_argument("--num", "-n", type=int, default=1000, help="queries in the batch")
    p.add_argument("--slowdown", type=float, default=3.0, help="engines sleep this x their compute per step")
    p.add_argument("--clusters", type=int, default=2, help="clusters (engine processes) of the default fleet")
    p.add_argument("--size", default="nano", help="size of the random local model")
    p.add_argument("--max-tokens", type=int, default=48, help="longest forced response")
    p.add_argument(
        "--lease-s", type=float, default=3.0, help="query lease of the engines (SIGSTOP outlasts it)"
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=60.0,
        help="after the last fault healed, a query not final by then is stuck",
    )
    p.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated subset of {', '.join(FAULTS)}"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/chaos", help="Redis data and process logs")


def format_report(r: dict) -> str:
    lines = [f"{'fault':<15} {'injected':>8} {'recovery s':>11}"]
    for f in FAULTS:
        rec = r["recovery_s"].get(f)
        lines.append(f"{f:<15} {r['faults'][f]:>8} {rec if rec is not None else '-':>11}")
    lines.append(
        f"{r['queries']} queries: lost {r['lost']}, duplicated {r['duplicated']}, stuck {r['stuck']}, "
        f"invariant violations {r['invariant_violations']} ({r['wall_s']} s)"
    )
    return "\n".join(lines)


def run(args) -> dict:
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    config = ChaosConfig(
        run_dir=Path(args.run_dir).resolve(),
        queries=args.num,
        clusters=args.clusters,
        size=args.size,
        max_tokens=args.max_tokens,
        lease_s=args.lease_s,
        slowdown=args.slowdown,
        settle_s=args.settle_s,
        seed=args.seed,
        faults=faults,
    )
    report = run_chaos(config)
    print(format_report(report), flush=True)
    return report
