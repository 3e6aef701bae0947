"""The work and control-plane faults of ``fleetbatch loadgen chaos``, each returning a :class:`load.chaos.bite.Bite`.

* ``racing_movers``: admin rebalances ``--apply`` on both replicas at once, with both offloaders.
  Evidence: the calls' status codes, at least one ``OK`` and every other one ``UNAVAILABLE``
  naming the mover lease.
* ``kv_exhaust``: rows longer than an engine's KV cache, over gRPC and in an OpenAI batch.
  Evidence: both rows failed with the KV cache's error.
* ``unwritable_store``: every file write of the gateways fails while an OpenAI batch finalizes.
  Evidence: ``finalize_failures`` >= 1 on the batch; once the run settled, the batch completed.
* ``restart_in_intake``: the engine of the only cluster that can take some rows is SIGKILLed
  while a large batch is in background intake. Evidence: the batch was in intake at the kill
  and still when the new engine heartbeat.
* ``remove_sole_cluster``: the second cluster removed while its queue holds a row only it can
  take. Evidence: ``FAILED_PRECONDITION`` naming the row while it was queued there; a row that
  was not queued there (a claim sent before the engine's pause took it) is a miss, the cluster is not removed,
  and the fault is retried once with a new row. The removal waits for earlier batches to leave intake.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import threading
from collections.abc import Callable

import grpc

from gateway.http_api.batches import PENDING, record_key
from load.chaos.bite import Bite
from load.chaos.faults import TOKEN
from load.chaos.waves import big_row, intake_rows, kv_row
from load.workload import generated
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from workqueue import keys
from workqueue.batches import INTAKE

log = logging.getLogger(__name__)

REMOVE_TRIES = 2
INTAKE_WAIT_S = 120.0  # how long the removal waits for earlier batches to leave intake


def _md(timeout: float) -> dict:
    return {"metadata": [("authorization", f"Bearer {TOKEN}")], "timeout": timeout}


def admin(target: str, call: Callable[[pb_grpc.AdminServiceStub], object]) -> tuple[str, str]:
    """Run an admin call; returns its status code's name (OK when it succeeded) and details."""
    with grpc.insecure_channel(target) as ch:
        try:
            call(pb_grpc.AdminServiceStub(ch))
            return "OK", ""
        except grpc.RpcError as e:
            log.warning("chaos: admin call on %s: %s %s", target, e.code().name, e.details())
            return e.code().name, e.details() or ""


class WorkFaults:
    """Load and admin faults for :class:`load.chaos.run.Chaos` (which provides the deployment and helpers)."""

    def racing_movers(self) -> Bite:
        calls: list[tuple[str, str]] = []

        def rebalance(target: str) -> None:
            for _ in range(5):
                calls.append(
                    admin(target, lambda a: a.Rebalance(pb.RebalanceRequest(dry_run=False), **_md(30)))
                )

        threads = [
            threading.Thread(target=rebalance, args=(g.address,)) for g in self.gateways for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        codes: dict[str, int] = {}
        for code, _ in calls:
            codes[code] = codes.get(code, 0) + 1
        bite = Bite({"codes": codes})
        self._healed(bite)
        log.warning("chaos: %d admin rebalances raced with two offloaders: %s", len(calls), codes)
        wrong = [f"{c} {d}" for c, d in calls if c != "OK" and not (c == "UNAVAILABLE" and "mover" in d)]
        if not codes.get("OK"):
            bite.miss("no rebalance was applied")
        if wrong:
            bite.miss(
                f"{len(wrong)} calls failed otherwise than UNAVAILABLE naming the mover, e.g. {wrong[0]}"
            )
        return bite

    def _kv_error(self, batch_id: str, query_id: str) -> str:
        for r in self.queue().results(batch_id):
            if r["query_id"] == query_id:
                return r.get("error") or f"not failed ({r.get('finish_reason')})"
        return "no result"

    def kv_exhaust(self) -> Bite:
        """Rows longer than an engine's KV cache, over gRPC and in an OpenAI batch; back when both are final."""
        grpc_id = self.submit("kv", [kv_row("kv-grpc-0"), *generated(3, seed=self.c.seed + 3, max_tokens=8)])
        run = self.openai_batch(
            "kv", [kv_row("kv-openai-0"), *generated(8, seed=self.c.seed + 4, max_tokens=8)]
        )
        self._wait(lambda: self._batch_final(grpc_id), self.c.settle_s)
        self._wait(lambda: self._batch_final(run.batch_id), self.c.settle_s)
        bite = Bite()
        self._healed(bite)
        errors = {
            "kv-grpc-0": self._kv_error(grpc_id, "kv-grpc-0"),
            "kv-openai-0": self._kv_error(run.batch_id, "kv-openai-0"),
        }
        bite.evidence["errors"] = errors
        wrong = {q: e for q, e in errors.items() if "kv cache" not in e.lower()}
        return bite.miss(f"rows not failed with the KV error: {wrong}") if wrong else bite

    def unwritable_store(self) -> Bite:
        """Every file write of both gateways fails (RLIMIT_FSIZE 0: ``EFBIG``, as on a full disk) while an
        OpenAI batch runs and finalizes, for ``store_s`` after the finalizer's first failed pass."""
        run = self.openai_batch("store", generated(8, seed=self.c.seed + 5, max_tokens=8))
        pids = [g.pid for g in self.gateways if g.pid is not None]
        limits = {pid: resource.prlimit(pid, resource.RLIMIT_FSIZE) for pid in pids}
        for pid, (_, hard) in limits.items():
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (0, hard))
        log.warning("chaos: file store unwritable for gateways %s", pids)
        r = self.queue().r
        bite = Bite()
        try:

            def tried() -> bool:  # the rows are done and the finalizer failed a pass (or it finalized)
                failures = int(r.hget(record_key(run.batch_id), "finalize_failures") or 0)
                return self._batch_final(run.batch_id) and (
                    failures >= 1 or not r.sismember(PENDING, run.batch_id)
                )

            self._wait(tried, self.c.settle_s)
            self._hold(self.c.store_s)
        finally:
            for pid, lim in limits.items():
                try:
                    resource.prlimit(pid, resource.RLIMIT_FSIZE, lim)
                except (ProcessLookupError, PermissionError):
                    pass
            self._healed(bite)
        log.warning("chaos: file store writable again")
        failures = self._read(lambda: int(r.hget(record_key(run.batch_id), "finalize_failures") or 0), 0)
        bite.evidence["finalize_failures"] = failures

        def finalized() -> str:
            status = run.batch.status if run.batch is not None else "unread"
            bite.evidence["status"] = status
            return "" if status == "completed" else f"the batch ended {status}, not completed"

        bite.confirm = finalized  # the run reads every OpenAI batch at its end
        return bite if failures >= 1 else bite.miss("the finalizer never failed a pass (it finished first)")

    def restart_in_intake(self) -> Bite:
        """SIGKILL the engine of the only cluster that can take the big rows while a large batch is in
        background intake; the supervisor restarts it."""
        batch_id = self.submit("intake", intake_rows(self.c.intake_rows, self.c.seed))
        r = self.queue().r
        self._wait(lambda: r.zscore(INTAKE, batch_id) is not None, 60)
        in_intake = self._read(lambda: int(r.zscore(INTAKE, batch_id) is not None), 0)
        bite = self._kill_and_restart(self.names[1], Bite())
        spanned = bool(in_intake) and self._read(lambda: int(r.zscore(INTAKE, batch_id) is not None), 0) == 1
        bite.evidence.update(in_intake_at_kill=bool(in_intake), intake_spanned_restart=spanned)
        if not in_intake:
            bite.miss("the batch was not in intake at the kill")
        elif not spanned:
            bite.miss("the intake ended before the engine was back")
        return bite

    def remove_sole_cluster(self) -> Bite:
        """Remove the second cluster (``force``) while its queue holds a row no other cluster can take.

        Its engine is paused (SIGSTOP) from the submit until 2 s after the removal, so the row is still
        queued when the cluster goes, and the worker, whose loop checks for removal (every 0.5 s) before
        it claims, sees the removal before it could claim again."""
        name = self.affected = self.names[1]
        bite = Bite()
        for attempt in range(REMOVE_TRIES):
            bite = self._remove_once(name, f"sole-{attempt}")
            if bite.bit:
                break
            log.warning(
                "chaos: remove_sole_cluster missed (%s); %s",
                bite.missed,
                "again" if attempt < REMOVE_TRIES - 1 else "giving up",
            )
        return bite

    def _remove_once(self, name: str, row: str) -> Bite:
        r = self.queue().r
        # the rows of earlier faults that only this cluster can take leave intake first: a removal while they wait
        # there fails them, rightly for the gateway and wrongly for this run
        if not self._wait(lambda: r.zcard(INTAKE) == 0, INTAKE_WAIT_S):
            log.warning(
                "chaos: batches still in intake after %.0f s; removing %s anyway", INTAKE_WAIT_S, name
            )
        pid = self.engines.procs[name].pid
        os.kill(pid, signal.SIGSTOP)
        code, details = "", ""
        try:
            batch_id = self.submit(row, [big_row(row)])
            key = keys.query(keys.gid(batch_id, row))
            self._wait(lambda: r.hget(key, "cluster") == name, 30)
            state = (r.hget(key, "state") or "final", r.hget(key, "cluster"))
            if state == ("queued", name):  # else a tick sent before the pause claimed it: no removal, so that
                code, details = admin(  # the next try finds the cluster still there
                    self.gateways[0].address,
                    lambda a: a.RemoveCluster(pb.RemoveClusterRequest(name=name, force=True), **_md(60)),
                )
                self._hold(2.0)
        finally:
            os.kill(pid, signal.SIGCONT)
            bite = Bite()
            self._healed(bite)  # the heal is the SIGCONT
        bite.evidence.update(row=row, row_state_at_removal=list(state), code=code, details=details[:200])
        if state != ("queued", name):
            if not self._wait(lambda: self._batch_final(batch_id), 60):  # it runs where it was claimed
                log.warning("chaos: %s not final 60 s after its claim; the retry may find it leased", row)
            return bite.miss(f"{row} was {state[0]} on {state[1]} before the removal, not queued on {name}")
        log.warning("chaos: removal of cluster %s while it holds %s: %s %s", name, row, code, details)
        if code != "FAILED_PRECONDITION" or row not in details:
            return bite.miss(
                f"the removal answered {code} {details[:120]!r}, not FAILED_PRECONDITION naming {row}"
            )
        return bite
