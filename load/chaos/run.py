"""``fleetbatch loadgen chaos``: one real deployment, fifteen fault kinds injected while batches run, then the books.

The deployment: an embedded Redis (AOF, ``appendfsync everysec``), two gateway replicas
(both run offloaders, background intake and the OpenAI-compatible HTTP front on one shared
files directory), one engine process per cluster kept alive by
:class:`gateway.deploy.supervisor.EngineSupervisor` (as under ``fleetbatch gateway up``), the first cluster's
engine talking to Redis through a TCP proxy the harness controls (:mod:`load.tcp_proxy`); with
``--wan-delay-ms``, every engine through its own proxy with that one-way delay (the clusters in
other clouds, Redis and the gateways in one; the ``wan`` entry of the report says so), and
clients that stream with ``start_index`` and switch replica on transient errors
(:mod:`load.chaos.client`). The first cluster takes only small queries (``max_query_tokens``),
the second any that fit its KV cache (:mod:`load.chaos.waves`).

**Faults follow progress, not the clock.** The load comes in waves, one per fault plus one:
fault ``k`` fires once ``--fire-at`` of wave ``k`` has results, and wave ``k + 1`` is submitted
only after fault ``k`` healed, so every kind fires on a fast machine and on a slow one. In the
order of :data:`FAULTS`: SIGKILL and SIGSTOP of a busy engine, SIGKILL of Redis, a Redis outage
of ``--outage-s``, a partition of ``--partition-s`` between the first engine and Redis (a
blackhole by default: ``--partition-mode``), racing admin rebalances, KV-exhausting rows, an
unwritable file store, an engine restart during intake, a SIGKILL of a gateway replica, replies lost
after Redis ran the call on the second engine's link and on the gateways' (both through a
:class:`load.reply_cut.ReplyCutProxy`), the cancel of a ``--large-cancel-rows`` batch at the head of
the queues, a Redis kept busy by a script past the clients' reply timeout, and the removal of a
cluster holding a row only it can take (:mod:`load.chaos.faults`, :mod:`load.chaos.faults_work`,
:mod:`load.chaos.faults_wide`).

**A fault counts only when it bit.** Each returns evidence (:class:`load.chaos.bite.Bite`):
leases held by the engine it hit, pings that failed, connections the partition froze and a
lapsed heartbeat, the admin calls' status codes, the KV error on the rows, a failed finalizer
pass, a batch still in intake, a refusal naming the row... ``faults`` counts the kinds that
bit, ``fault_misses`` says why the others did not, ``evidence`` holds what each did.

Then the books (:mod:`load.chaos.books`); the run fails (exit code 1) when a count there is
above 0, a fault did not bite, a client met a permanent error, a row whose only fault was a lost
reply used another attempt (``attempts_used_by_lost_replies``), or the longest SLOWLOG entry of the
large cancel passed 50 ms (``redis_max_blocked_ms``). ``recovery_s``: per fault,
seconds from the moment it healed (Redis started, proxy healed, SIGCONT sent, process
restarted...) to the next result written (by the cluster it hit, for a fault on one engine).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from clusterfile import dump_cluster_file
from gateway.deploy.supervisor import EngineSupervisor
from gateway.deploy.up import default_clusters
from load.chaos.bite import Bite
from load.chaos.books import GrpcBatch, format_report, grpc_books, merged_counts, verdict
from load.chaos.client import ResilientClient
from load.chaos.config import FAULTS, ChaosConfig, add_arguments, config_from_args  # noqa: F401  (add_arguments: the CLI reads it here)
from load.chaos.faults import CLIENT_TOKEN, HELD_WAVE_FAULTS, TOKEN, ProcessFaults
from load.chaos.faults_wide import WideFaults
from load.chaos.faults_work import WorkFaults
from load.chaos.openai_view import OpenAIBatches, OpenAIRun, user_view
from load.chaos.procs import GatewayProcess, RestartableRedis
from load.chaos.waves import KV_BUDGET, SMALL_LIMIT, held, waves
from load.client import to_request
from load.reply_cut import ReplyCutProxy
from load.tcp_proxy import Link, TcpProxy
from load.workload import WorkItem
from workqueue import WorkQueue, connect
from workqueue.invariants import check

log = logging.getLogger(__name__)

T = TypeVar("T")
RECOVERY_WAIT_S = 120.0  # how long after a heal the run watches for the next result


class Chaos(ProcessFaults, WorkFaults, WideFaults):
    def __init__(self, config: ChaosConfig):
        self.c = config
        self.stop = threading.Event()
        self.injected: dict[str, int] = dict.fromkeys(FAULTS, 0)  # faults that bit
        self.bites: dict[str, Bite] = {}
        self.current = ""  # the fault being injected
        self.wave = ""  # the batch id of the wave it fires on
        self.watchers: list[threading.Thread] = []
        self.recovery_s: dict[str, float] = {}
        self.notes: dict[str, object] = {}
        self.restarts_observed = 0
        self.restarts_missed: list[str] = []
        self.affected: str | None = None
        self.redis: RestartableRedis | None = None
        self.proxy: TcpProxy | None = None  # the first engine's, which the partition cuts
        self.proxies: dict[str, TcpProxy] = {}  # cluster -> its engine's proxy to Redis
        self.gateways: list[GatewayProcess] = []
        self.engines: EngineSupervisor | None = None
        self.names: list[str] = []
        self.batches: list[GrpcBatch] = []
        self.clients: list[ResilientClient] = []
        self.openai: OpenAIBatches | None = None
        self.openai_runs: list[OpenAIRun] = []
        self.engine_cut: ReplyCutProxy | None = None  # the second engine's link: loses replies (faults_wide)
        self.gateway_cut: ReplyCutProxy | None = None  # the gateways' link: loses replies
        self.lost_claims: dict[str, int] = {}  # gid -> its attempts when a claim's reply was lost
        self.lost_reply_batches: list[str] = []  # batches whose only fault was lost replies
        self.redis_max_blocked_ms: float | None = None  # the longest SLOWLOG entry of large_cancel
        self.tag = secrets.token_hex(3)  # batch ids unique to this run (the Redis data dir may be reused)

    # ------------------------------------------------------------------ set-up

    def start(self) -> None:
        c = self.c
        logs = c.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.redis = RestartableRedis(c.run_dir / "redis")
        specs = default_clusters(2, "native", c.size)
        self.names = [s.name for s in specs]
        link = Link(delay_s=c.wan_delay_ms / 1000, jitter_s=c.wan_jitter_ms / 1000)
        sock = self.redis.url.removeprefix("unix://")
        self.engine_cut, self.gateway_cut = ReplyCutProxy(sock).start(), ReplyCutProxy(sock).start()
        for i, s in enumerate(specs):
            s.engine_args += ["--lease-s", str(c.lease_s), "--slowdown", str(c.slowdown)]
            s.engine_args += ["--kv-budget-tokens", str(KV_BUDGET), *c.engine_args]
            cut = i == 1 and "reply_lost_engine" in c.faults  # the second: through the reply-cut proxy
            upstream = ("127.0.0.1", self.engine_cut.port) if cut else sock
            if cut:
                s.redis_url = self.engine_cut.url
            if i == 0 or c.wan:  # the first: the partition cuts it; with a WAN, every engine
                proxy = self.proxies[s.name] = TcpProxy(upstream).start()
                proxy.set_links(up=link, down=link)
                s.redis_url = f"redis://{proxy.address}/0"
        self.proxy = self.proxies[specs[0].name]  # the partition cuts this one
        rows = [{"name": s.name, "capacity_tps": s.capacity_tps} for s in specs]
        rows[0]["max_query_tokens"] = SMALL_LIMIT
        clusters_file = c.run_dir / "clusters.yaml"
        dump_cluster_file(clusters_file, rows)
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
                self.gateway_cut.url if "reply_lost_gateway" in c.faults else self.redis.url,
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
        for proxy in [*self.proxies.values(), self.engine_cut, self.gateway_cut]:
            if proxy is not None:
                proxy.close()
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

    def add_direct_batch(self, name: str, batch_id: str, ids: list[str]) -> None:
        """A batch written straight to Redis (no client streams it): the books count it as the others."""
        self.batches.append(GrpcBatch(name, batch_id, ids, None))

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
        return sum(
            1 for b in self.batches if b.client for r in q.results(b.batch_id) if r.get("cluster") == cluster
        )

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

    def _read(self, fn: Callable[[], T], default: T) -> T:
        """``fn()``, retried (bounded) while Redis is unreachable; ``default`` if it never answers."""
        box: list[T] = []
        self._wait(lambda: box.append(fn()) is None, 60)
        return box[0] if box else default

    def _batch_final(self, batch_id: str) -> bool:
        try:
            b = self.queue().batch(batch_id)
        except Exception:  # noqa: BLE001
            return False
        return b is not None and b.final

    # ------------------------------------------------------------------ the run

    def _healed(self, bite: Bite) -> None:
        """The fault being injected healed now: note the time, and watch in the background for the next
        result (by the cluster it hit, if one), which sets its ``recovery_s``."""
        bite.healed_at = healed = time.monotonic()
        fault, affected = self.current, self.affected
        before = self._read(lambda: self._progress(affected), default=-1)

        def watch() -> None:
            while before >= 0 and not self.stop.is_set() and time.monotonic() - healed < RECOVERY_WAIT_S:
                try:
                    if self._progress(affected) > before:
                        self.recovery_s[fault] = round(time.monotonic() - healed, 2)
                        return
                except (OSError, redis.RedisError):
                    pass
                self.stop.wait(0.25)

        t = threading.Thread(target=watch, name=f"chaos-recovery-{fault}", daemon=True)
        t.start()
        self.watchers.append(t)

    def run(self) -> dict:
        c = self.c
        t0 = time.monotonic()
        load = waves(c.queries, len(c.faults) + 1, c.seed, c.max_tokens)
        for k, fault in enumerate(c.faults):
            if fault in HELD_WAVE_FAULTS and load[k]:
                load[k][0] = held(load[k][0])
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
            self.affected, self.wave, self.current = None, wave, fault
            bite = self.bites[fault] = getattr(self, fault)()
            if bite.bit:
                self.injected[fault] += 1
            else:
                log.error("chaos: %s did not bite: %s", fault, bite.missed)
            last_heal = bite.healed_at or time.monotonic()
            self.notes.setdefault("fault_s", {})[fault] = round(last_heal - t_fault, 2)
            wave = self.submit(f"w{k + 1}", load[k + 1])
        self._wait(
            lambda: all(self._batch_final(b.batch_id) for b in self.batches),
            max(0.0, last_heal + c.settle_s - time.monotonic()),
        )
        # every client reads its batch to the end (bounded), so the books hold the rows they received too
        self._wait(
            lambda: all(not b.client or b.client.final is not None or b.client.fatal for b in self.batches),
            30,
        )
        for run in self.openai_runs:
            self.openai.read(run, max(30.0, last_heal + c.settle_s - time.monotonic()))
        seen_by = time.monotonic() + 5.0  # all settled: a watcher still waiting has no result to see
        for t in self.watchers:
            t.join(timeout=max(0.0, seen_by - time.monotonic()))
        for fault, bite in self.bites.items():  # checks that need the settled run
            why = bite.confirm() if bite.confirm is not None and bite.bit else ""
            if why:
                bite.miss(why)
                self.injected[fault] -= 1
        return self._books(time.monotonic() - t0)

    def _books(self, wall_s: float) -> dict:
        q = self.queue()
        self._wait(lambda: sum(i.inflight for i in q.clusters()) == 0, 30)
        g = grpc_books(q, self.batches)
        u = user_view(self.openai_runs)
        infos = q.clusters(self.names)
        report = {
            "faults": dict(self.injected),
            "fault_misses": {f: b.missed for f, b in self.bites.items() if not b.bit},
            "queries": sum(len(b.ids) for b in self.batches) + sum(len(r.rows) for r in self.openai_runs),
            "lost": g["lost"],
            "duplicated": g["duplicated"],
            "stuck": g["stuck"],
            "overcounted": g["overcounted"],
            "count_mismatches": g["count_mismatches"],
            "invariant_violations": len(violations := check(q.r)),
            "output_lines_missing": u["output_lines_missing"],
            "output_lines_duplicated": u["output_lines_duplicated"],
            "wrongly_failed": g["wrongly_failed_rows"] + u["wrongly_failed_lines"],
            "openai_violations": u["openai_violations"],
            "engines_not_restarted": len(self.restarts_missed),
            "engine_restarts": self.restarts_observed,
            "recovery_s": self.recovery_s,
            "evidence": {f: b.evidence for f, b in self.bites.items()},
            "client_failures": [
                f"{b.name}: {b.client.fatal}" for b in self.batches if b.client and b.client.fatal
            ],
            "attempts_used_by_lost_replies": self.lost_reply_attempts(),
            "redis_max_blocked_ms": self.redis_max_blocked_ms,
            "count_problems": g["count_problems"],
            "wrongly_failed_examples": g["wrongly_failed_examples"],
            "openai_problems": u["openai_problems"],
            "notes": self.notes,
            "invariant_examples": violations[:5],
            "client_received": sum(len(cl.results) for cl in self.clients),
            "client_errors": merged_counts(cl.errors for cl in self.clients),
            "engines_alive": sum(i.alive for i in infos),
            "wan": {
                "one_way_delay_ms": self.c.wan_delay_ms,
                "jitter_ms": self.c.wan_jitter_ms,
                "engines_behind_proxy": len(self.proxies),
                "partition_s": self.c.partition_s,
            },
            "wall_s": round(wall_s, 1),
        }
        report["problems"] = verdict(report, self.c.faults)
        if report["attempts_used_by_lost_replies"]:
            report["problems"].append(
                f"attempts_used_by_lost_replies = {report['attempts_used_by_lost_replies']}"
            )
        goal = self.c.blocked_goal_ms
        if goal is not None and (self.redis_max_blocked_ms or 0) > goal:
            report["problems"].append(
                f"redis_max_blocked_ms = {self.redis_max_blocked_ms} (goal <= {goal:g})"
            )
        report["ok"] = not report["problems"]
        return report


def run_chaos(config: ChaosConfig) -> dict:
    chaos = Chaos(config)
    try:
        chaos.start()
        return chaos.run()
    finally:
        chaos.close()


def run(args) -> dict:
    report = run_chaos(config_from_args(args))
    print(format_report(report, FAULTS), flush=True)
    return report
