"""The eleven fault kinds of ``loadgen chaos``, each injected and healed on real processes and sockets.

Each method injects one fault and returns once it healed (bounded waits throughout). A killed
engine counts as restarted only once the supervisor started a new process *and* that process
sent a heartbeat (:meth:`FaultsMixin._restart_observed`): the run does not guess from counters
the supervisor resets after a minute of stable running.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import threading
import time
from collections.abc import Callable

import grpc

from gateway.openai_batches import PENDING, record_key
from load.chaos_load import big_row, intake_rows, kv_row
from load.workload import generated
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from workqueue import keys
from workqueue.batches import INTAKE

log = logging.getLogger(__name__)

TOKEN = "chaos-admin-token"
CLIENT_TOKEN = "chaos-client-token-0001"  # the batch client's Bearer token (as client "chaos")


class FaultsMixin:
    """Fault injection for :class:`load.chaos.Chaos` (which provides the deployment and the helpers)."""

    injected: dict[str, int]
    notes: dict[str, object]
    restarts_observed: int
    restarts_missed: list[str]
    affected: str | None  # the cluster a fault hit, if one: its recovery is its next result

    # ------------------------------------------------------------------ shared helpers

    def _hold(self, seconds: float) -> None:
        """Sleep while the supervisor keeps being driven."""
        self._wait(lambda: False, seconds)

    def _heartbeat_since(self, name: str, since: float) -> bool:
        info = self.queue().clusters([name])[0]
        return info.alive and info.last_heartbeat > since

    def _restart_observed(self, name: str, old_pid: int, since: float) -> bool:
        """Wait (bounded) until the supervisor restarted engine ``name`` and the new process heartbeats."""

        def back() -> bool:
            p = self.engines.procs[name]
            return p.pid != old_pid and p.poll() is None and self._heartbeat_since(name, since)

        if self._wait(back, self.c.restart_timeout_s):
            self.restarts_observed += 1
            return True
        self.restarts_missed.append(name)
        log.error("chaos: engine %s was not restarted within %.0f s", name, self.c.restart_timeout_s)
        return False

    def _busiest_engine(self) -> str:
        """The running engine (process up, heartbeat live) holding the most leases."""
        infos = [
            i
            for i in self.queue().clusters(self.names)
            if i.alive and i.state == "active" and self.engines.procs[i.name].poll() is None
        ]
        return max(infos, key=lambda i: i.inflight).name if infos else self.names[-1]

    def _all_engines_back(self, since: float) -> bool:
        return all(p.poll() is None for p in self.engines.procs.values()) and all(
            self._heartbeat_since(n, since) for n in self.names
        )

    def _admin(self, target: str, call: Callable[[pb_grpc.AdminServiceStub], object]) -> str:
        """Run an admin call; returns its status code's name (OK when it succeeded)."""
        with grpc.insecure_channel(target) as ch:
            try:
                call(pb_grpc.AdminServiceStub(ch))
                return "OK"
            except grpc.RpcError as e:
                log.warning("chaos: admin call on %s: %s %s", target, e.code().name, e.details())
                return e.code().name

    def _kill_and_restart(self, name: str) -> None:
        self.affected = name
        pid = self.engines.procs[name].pid
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        log.warning("chaos: SIGKILL engine %s (pid %d)", name, pid)
        self._restart_observed(name, pid, killed_at)

    # ------------------------------------------------------------------ the five of before

    def kill_engine(self) -> None:
        self._kill_and_restart(self._busiest_engine())

    def stop_engine(self) -> None:
        name = self.affected = self._busiest_engine()
        pid = self.engines.procs[name].pid
        os.kill(pid, signal.SIGSTOP)
        log.warning("chaos: SIGSTOP engine %s for %.1f s (lease %.1f s)", name, self.c.stop_s, self.c.lease_s)
        self._hold(self.c.stop_s)
        os.kill(pid, signal.SIGCONT)
        resumed_at = time.time()
        self._wait(lambda: self._heartbeat_since(name, resumed_at), 120)

    def kill_redis(self) -> None:
        self.redis.kill()
        log.warning("chaos: SIGKILL Redis")
        self._hold(1.5)
        self.redis.restart()
        back = time.time()
        self._wait(lambda: self._all_engines_back(back), 120)

    def racing_movers(self) -> None:
        def rebalance(target: str) -> None:
            for _ in range(5):
                self._admin(target, lambda a: a.Rebalance(pb.RebalanceRequest(dry_run=False), **self._md(30)))

        threads = [
            threading.Thread(target=rebalance, args=(g.address,)) for g in self.gateways for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        log.warning("chaos: %d admin rebalances raced with two offloaders", 5 * len(threads))

    def kill_gateway(self) -> None:
        """SIGKILL the replica the current wave's client streams from, then restart it on its ports."""
        target = self.clients[-1].target
        g = next(g for g in self.gateways if g.address == target)
        g.kill()
        log.warning("chaos: SIGKILL gateway %s", g.name)
        self._hold(1.0)
        g.start()

    # ------------------------------------------------------------------ the six of issue 31

    def redis_outage(self) -> None:
        """Redis down for ``outage_s`` (at least twice the lease), then back on its data."""
        self.redis.kill()
        log.warning("chaos: Redis down for %.1f s (lease %.1f s)", self.c.outage_s, self.c.lease_s)
        self._hold(self.c.outage_s)
        self.redis.restart()
        back = time.time()
        self._wait(lambda: self._all_engines_back(back), 120)

    def partition(self) -> None:
        """Cut the proxy between the first cluster's engine and Redis for ``partition_s``."""
        name = self.affected = self.names[0]
        dropped = self.proxy.cut()
        log.warning(
            "chaos: partition %s <-> Redis for %.1f s (%d connections cut)", name, self.c.partition_s, dropped
        )
        self._hold(self.c.partition_s)
        self.proxy.heal()
        healed = time.time()
        self._wait(lambda: self._heartbeat_since(name, healed), 120)

    def kv_exhaust(self) -> None:
        """Rows longer than an engine's KV cache, over gRPC and in an OpenAI batch; back when both are final."""
        grpc_id = self.submit("kv", [kv_row("kv-grpc-0"), *generated(3, seed=self.c.seed + 3, max_tokens=8)])
        run = self.openai_batch(
            "kv", [kv_row("kv-openai-0"), *generated(8, seed=self.c.seed + 4, max_tokens=8)]
        )
        self._wait(lambda: self._batch_final(grpc_id), self.c.settle_s)
        self._wait(
            lambda: self.openai.status(run) in ("completed", "failed", "cancelled", "expired"),
            self.c.settle_s,
        )

    def unwritable_store(self) -> None:
        """Every file write of both gateways fails (RLIMIT_FSIZE 0: ``EFBIG``, as on a full disk) while an
        OpenAI batch runs and finalizes, for ``store_s`` after the finalizer's first failed pass."""
        run = self.openai_batch("store", generated(8, seed=self.c.seed + 5, max_tokens=8))
        pids = [g.pid for g in self.gateways if g.pid is not None]
        limits = {pid: resource.prlimit(pid, resource.RLIMIT_FSIZE) for pid in pids}
        for pid, (_, hard) in limits.items():
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (0, hard))
        log.warning("chaos: file store unwritable for gateways %s", pids)
        try:
            r = self.queue().r

            def tried() -> bool:  # the rows are done and the finalizer failed a pass (or gave up, or wrote)
                failures = int(r.hget(record_key(run.batch_id), "finalize_failures") or 0)
                return self._batch_final(run.batch_id) and (
                    failures >= 1 or not r.sismember(PENDING, run.batch_id)
                )

            self.notes["store_finalize_tried"] = self._wait(tried, self.c.settle_s)
            self._hold(self.c.store_s)
        finally:
            for pid, lim in limits.items():
                try:
                    resource.prlimit(pid, resource.RLIMIT_FSIZE, lim)
                except (ProcessLookupError, PermissionError):
                    pass
        log.warning("chaos: file store writable again")

    def restart_in_intake(self) -> None:
        """SIGKILL the engine of the only cluster that can take the big rows while a large batch is in
        background intake; the supervisor restarts it."""
        batch_id = self.submit("intake", intake_rows(self.c.intake_rows, self.c.seed))
        r = self.queue().r
        in_intake = self._wait(lambda: r.zscore(INTAKE, batch_id) is not None, 60)
        self._kill_and_restart(self.names[1])
        self.notes["intake_spanned_restart"] = bool(in_intake and r.zscore(INTAKE, batch_id) is not None)

    def remove_sole_cluster(self) -> None:
        """Remove the second cluster (``force``) while its queue holds a row no other cluster can take.

        Its engine is paused (SIGSTOP) from the submit until 2 s after the removal, so the row is still
        queued when the cluster goes, and the worker, whose loop checks for removal (every 0.5 s) before
        it claims, sees the removal before it could claim again."""
        name = self.names[1]
        pid = self.engines.procs[name].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            batch_id = self.submit("sole", [big_row("sole-0")])
            r = self.queue().r
            key = keys.query(keys.gid(batch_id, "sole-0"))
            self._wait(lambda: r.hget(key, "cluster") == name, 30)
            self.notes["sole_state_at_removal"] = r.hget(key, "state") or "final"
            code = self._admin(
                self.gateways[0].address,
                lambda a: a.RemoveCluster(pb.RemoveClusterRequest(name=name, force=True), **self._md(60)),
            )
            self._hold(2.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        self.notes["remove_cluster"] = code
        log.warning("chaos: cluster %s removed while holding sole-0: %s", name, code)

    def _md(self, timeout: float) -> dict:
        return {"metadata": [("authorization", f"Bearer {TOKEN}")], "timeout": timeout}
