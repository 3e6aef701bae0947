"""The wider fault model of ``fleetbatch loadgen chaos`` (issue 48): replies lost after Redis ran the call, a Redis
kept busy past the clients' reply timeout, and the cancel of a large batch at the head of the queues.

* ``reply_lost_engine``: the second cluster's engine reaches Redis through a :class:`load.reply_cut.ReplyCutProxy`;
  it loses the reply to a tick whose CLAIM handed out queries and to a tick writing results (COMPLETE), each
  after Redis ran it; redis-py sends the tick again. Evidence: the calls hit, the rows the lost claims handed
  out (each must end with the attempt it had then: ``attempts_used_by_lost_replies``), the engine's log.
* ``reply_lost_gateway``: both gateways reach Redis through another such proxy; it loses the reply to the
  first staging append (STAGE_APPEND) of a batch sent by ``SubmitBatchStream``, to its first intake chunk
  (ENQUEUE_CHUNK) in background intake, then to the CANCEL of that batch sent through the gateway. Evidence: both calls hit, the cancel answered OK, the batch ended cancelled with every
  row once (the ``cut-`` rows may end cancelled: :data:`CANCELLABLE`).
* ``redis_slow``: one EVAL busy for the clients' reply timeout + 2 s (``DEBUG SLEEP`` is off in the Redis the
  project runs): Redis answers nobody, then ``BUSY``. Evidence: the script's length, failed pings, every
  engine heartbeating again afterwards.
* ``large_cancel``: a batch of ``--large-cancel-rows`` cheap rows written straight to the queues (both
  clusters, a 10-minute window: the head of every queue), then cancelled through the gateway. SLOWLOG
  (``slowlog-log-slower-than`` 1 ms, reset before the cancel) is read once the batch is final:
  ``redis_max_blocked_ms`` is its longest entry (goal <= 50).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import threading
import time

import grpc
import redis

from gateway.batches.quota import creation_writes
from gateway.grpc_api.tls import channel
from load.chaos.bite import Bite, DownProbe
from load.chaos.faults import CLIENT_TOKEN
from load.chaos.waves import big_row
from load.client import to_request
from load.reply_cut import ReplyCutProxy, decode
from load.workload import generated
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from workqueue import batch_scripts, keys, scripts
from workqueue.embedded import client_options
from workqueue.intake_ops import STAGE_APPEND
from workqueue.records import QueuedQuery

log = logging.getLogger(__name__)

#: rows that may end cancelled: the batches this module cancels on purpose
CANCELLABLE = ("cut-", "large-")
SLOWLOG_US = 1000  # SLOWLOG keeps every command of 1 ms or more during large_cancel
BUSY = """
local t0 = redis.call('TIME')
local start, n = t0[1] * 1000000 + t0[2], 0
repeat
  local t = redis.call('TIME')
  n = n + 1
until t[1] * 1000000 + t[2] - start >= tonumber(ARGV[1]) * 1000
return n
"""
RESENT = re.compile(r"write resent|resent")


def sha(source: str) -> bytes:
    """The SHA redis-py sends with ``EVALSHA`` for ``source``."""
    return hashlib.sha1(source.encode()).hexdigest().encode()


def hands_out(reply: bytes) -> bool:
    """Whether a CLAIM's reply hands out queries (an empty claim is answered afresh when sent again)."""
    value = decode(reply)
    return isinstance(value, list) and len(value) > 1


def claimed(reply: bytes) -> dict[str, int]:
    """The queries a CLAIM's lost reply handed out: gid -> its attempts then."""
    _, *flat = decode(reply)
    step = scripts.CLAIMED_FIELDS
    return {flat[i].decode(): int(flat[i + 2]) for i in range(0, len(flat) - step + 1, step)}


def cancellable(query_id: str) -> bool:
    return query_id.startswith(CANCELLABLE)


class WideFaults:
    """Lost replies, a slow Redis and a large cancel for :class:`load.chaos.run.Chaos`."""

    engine_cut: ReplyCutProxy | None
    gateway_cut: ReplyCutProxy | None

    def _cancel(self, batch_id: str) -> tuple[str, str]:
        """CancelBatch through the first gateway, as the batch's client; its status code's name and details."""
        code, details = "", ""
        for _ in range(3):
            with channel(self.gateways[0].address, token=CLIENT_TOKEN) as ch:
                try:
                    pb_grpc.BatchServiceStub(ch).CancelBatch(
                        pb.CancelBatchRequest(batch_id=batch_id), timeout=120
                    )
                    return "OK", ""
                except grpc.RpcError as e:
                    code, details = e.code().name, e.details() or ""
            if code != "UNAVAILABLE":
                break
            time.sleep(1.0)
        return code, details

    def _row_attempts(self, gids) -> dict[str, int]:
        """gid -> attempts of its result row, for the ``gids`` that have one."""
        want: dict[str, set[str]] = {}
        for g in gids:
            b, qid = keys.split_gid(g)
            want.setdefault(b, set()).add(qid)
        q, out = self.queue(), {}
        for b, qids in want.items():
            for r in q.results(b):
                if r["query_id"] in qids:
                    out[keys.gid(b, r["query_id"])] = int(r.get("attempts") or 0)
        return out

    def lost_reply_attempts(self) -> int:
        """Rows whose only fault was a lost reply that ended with more than one attempt (goal 0)."""
        first = {g: a for g, a in self.lost_claims.items() if a <= 1}
        now = self._read(lambda: self._row_attempts(first), {})
        used = sum(1 for g in first if now.get(g, 0) > 1)
        for b in self.lost_reply_batches:
            rows = self._read(lambda b=b: self.queue().results(b), [])
            used += sum(1 for r in rows if int(r.get("attempts") or 0) > 1)
        return used

    # ------------------------------------------------------------------ lost replies

    def reply_lost_engine(self) -> Bite:
        name = self.affected = self.names[1]
        p, logs = self.engine_cut, self._logs()
        p.arm("tick_claim", b"EVALSHA", sha(scripts.CLAIM), reply=hands_out)
        p.arm("tick_results", b"EVALSHA", sha(scripts.COMPLETE))
        log.warning(
            "chaos: losing replies of %s's ticks (a claim, a result write) after Redis ran them", name
        )
        self.submit("lost", [big_row(f"lost-{i}") for i in range(4)])  # rows only this engine can take
        self._wait(lambda: p.hit_count("tick_claim") and p.hit_count("tick_results"), self.c.settle_s)
        p.disarm()
        bite = Bite({"engine": name})
        self._healed(bite)
        hits = {k: p.hit_count(k) for k in ("tick_claim", "tick_results")}
        rows: dict[str, int] = {}
        for h in p.hits["tick_claim"]:
            rows.update(claimed(h.reply))
        self.lost_claims.update(rows)
        done = self._wait(lambda: len(self._row_attempts(rows)) == len(rows), self.c.settle_s)
        final = self._read(lambda: self._row_attempts(rows), {})
        bite.evidence.update(
            calls_hit=hits, rows_in_lost_claims=len(rows), rows_finished=done,
            rows_with_another_attempt=sum(1 for g, a in rows.items() if final.get(g, 0) > a),
            engine_logged_resent=name in logs.saw(RESENT),
        )  # fmt: skip
        if not all(hits.values()):
            return bite.miss(f"not every kind of tick call lost its reply: {hits}")
        return bite if rows else bite.miss("the lost claim handed out no query")

    def _submit_stream(self, request: pb.SubmitBatchRequest, part_rows: int = 64) -> str:
        """SubmitBatchStream through the first gateway (its rows staged in Redis part by part); the status code."""
        queries = list(request.queries)

        def parts():
            for i in range(0, len(queries), part_rows):
                m = pb.SubmitBatchRequest(queries=queries[i : i + part_rows])
                if i == 0:
                    m.CopyFrom(request)
                    del m.queries[part_rows:]
                m.end_of_batch = i + part_rows >= len(queries)
                yield m

        with channel(self.gateways[0].address, token=CLIENT_TOKEN) as ch:
            try:
                pb_grpc.BatchServiceStub(ch).SubmitBatchStream(parts(), timeout=120)
                return "OK"
            except grpc.RpcError as e:
                log.warning("chaos: SubmitBatchStream: %s %s", e.code().name, e.details())
                return e.code().name

    def reply_lost_gateway(self) -> Bite:
        """The batch goes in by SubmitBatchStream (staged, then background intake); its client then submits
        it again (idempotent by batch id) and streams its results."""
        p = self.gateway_cut
        p.arm("staging", b"EVALSHA", sha(STAGE_APPEND))
        p.arm("intake_chunk", b"EVALSHA", sha(batch_scripts.ENQUEUE_CHUNK))
        items = [
            dataclasses.replace(it, id=f"cut-{i:05d}")
            for i, it in enumerate(generated(self.c.intake_rows, seed=self.c.seed + 11, max_tokens=2))
        ]
        streamed = self._submit_stream(to_request(items, f"chaos-{self.c.seed}-{self.tag}-cut"))
        batch_id = self.submit("cut", items)
        self.lost_reply_batches.append(batch_id)
        log.warning(
            "chaos: losing the reply of the gateways' intake chunk of %s, then of its cancel", batch_id
        )
        self._wait(lambda: p.hit_count("intake_chunk") > 0, self.c.settle_s)
        self._hold(1.0)  # the chunk sent again lands
        p.arm("cancel", b"EVALSHA", sha(batch_scripts.CANCEL))
        code, details = self._cancel(batch_id)
        p.disarm()
        bite = Bite()
        self._healed(bite)
        final = self._wait(lambda: self._batch_final(batch_id), self.c.settle_s)
        info = self._read(lambda: self.queue().batch(batch_id), None)
        hits = {k: p.hit_count(k) for k in ("staging", "intake_chunk", "cancel")}
        bite.evidence.update(
            calls_hit=hits, submit_stream=streamed, cancel=code, batch=batch_id, final=final,
            status=getattr(info, "status", None),
            counts=[getattr(info, k, None) for k in ("completed", "failed", "cancelled")],
        )  # fmt: skip
        if not all(hits.values()):
            return bite.miss(f"not every kind of gateway call lost its reply: {hits}")
        if code != "OK":
            return bite.miss(f"the cancel answered {code} {details[:120]!r}")
        return bite

    # ------------------------------------------------------------------ a slow Redis

    def redis_slow(self) -> Bite:
        timeout_s = float(client_options()["socket_timeout"])
        busy_ms = int((timeout_s + 2.0) * 1000)
        logs, probe = self._logs(), DownProbe(self.redis.url)
        client = redis.Redis.from_url(self.redis.url, socket_timeout=timeout_s + 60, retry=None)
        box: list = []

        def busy() -> None:
            t0 = time.monotonic()
            try:
                box.append((int(client.eval(BUSY, 0, busy_ms)), time.monotonic() - t0))
            except redis.RedisError as e:
                box.append((0, f"{type(e).__name__}: {e}"))

        log.warning("chaos: Redis busy in a script for %d ms (reply timeout %.1f s)", busy_ms, timeout_s)
        t = threading.Thread(target=busy, name="chaos-redis-slow", daemon=True)
        t.start()
        self._wait(lambda: probe.poll() or not t.is_alive(), busy_ms / 1000 + 60)
        client.close()
        bite = Bite()
        self._healed(bite)
        back = time.time()
        engines_back = self._wait(lambda: self._all_engines_back(back), 120)
        loops, took = box[0] if box else (0, "no reply")
        bite.evidence.update(
            busy_ms=busy_ms, script_s=round(took, 2) if isinstance(took, float) else took, time_calls=loops,
            failed_pings=probe.failed, engines_back=engines_back, engines_logged_errors=logs.saw(),
        )  # fmt: skip
        if not isinstance(took, float) or took < timeout_s:
            return bite.miss(f"the script did not keep Redis busy past the {timeout_s:g} s timeout: {took}")
        if probe.failed == 0:
            return bite.miss("no ping failed while the script ran")
        return bite if engines_back else bite.miss("not every engine heartbeat after the script")

    # ------------------------------------------------------------------ a large cancel

    def large_cancel(self) -> Bite:
        n, q = self.c.large_cancel_rows, self.queue()
        batch_id = f"chaos-{self.c.seed}-{self.tag}-large"
        rows = [
            (QueuedQuery(batch_id, f"large-{i:06d}", "hi", 1, 2, 1.0, forced_length=1), self.names[i % 2])
            for i in range(n)
        ]
        t0 = time.monotonic()
        q.create_batch(batch_id, rows, window_s=600.0, extra=creation_writes(batch_id, "chaos", None))
        self.add_direct_batch("large", batch_id, [qid for qid, _ in ((r.query_id, c) for r, c in rows)])
        created_s = time.monotonic() - t0
        r = q.r
        r.config_set("slowlog-max-len", 100_000)
        r.config_set("slowlog-log-slower-than", SLOWLOG_US)
        queued = sum(int(r.zcard(keys.queue(c))) for c in self.names)
        r.slowlog_reset()
        log.warning("chaos: cancelling %s, %d rows, %d queued in all", batch_id, n, queued)
        t1 = time.monotonic()
        code, details = self._cancel(batch_id)
        answered_s = time.monotonic() - t1
        final = self._wait(lambda: self._batch_final(batch_id), self.c.settle_s)
        swept_s = time.monotonic() - t1
        entries = self._read(lambda: r.slowlog_get(100_000), [])
        self._read(lambda: r.config_set("slowlog-log-slower-than", 10_000), None)
        bite = Bite()
        self._healed(bite)
        worst = max(entries, key=lambda e: e["duration"], default=None)
        self.redis_max_blocked_ms = round(worst["duration"] / 1000, 2) if worst else 0.0
        info = self._read(lambda: q.batch(batch_id), None)
        bite.evidence.update(
            rows=n, queued_at_cancel=queued, created_s=round(created_s, 2), cancel=code,
            cancel_answered_s=round(answered_s, 2), swept_s=round(swept_s, 2), final=final,
            cancelled=getattr(info, "cancelled", None), slowlog_entries=len(entries),
            redis_max_blocked_ms=self.redis_max_blocked_ms,
            slowest=[(round(e["duration"] / 1000, 1), _command(e)) for e in sorted(entries, key=lambda e: -e["duration"])[:3]],
        )  # fmt: skip
        if code != "OK":
            return bite.miss(f"the cancel answered {code} {details[:120]!r}")
        if queued < n // 2:
            return bite.miss(f"only {queued} rows were queued at the cancel")
        return bite if final else bite.miss("the batch was not final after the sweep")


def _command(entry: dict) -> str:
    cmd = entry.get("command", b"")
    text = cmd.decode("utf-8", "replace") if isinstance(cmd, bytes) else str(cmd)
    return text[:80]
