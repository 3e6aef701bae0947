"""The clusters' part of the queue: registration, state, heartbeats, the clusters' view, observed lengths.

:class:`Clusters` keeps the cluster set and each cluster's hash (its state ``active``,
``draining`` or ``removed``, its configured capacity), publishes workers' heartbeats (a
cluster counts as alive while its heartbeat key lives), reads every cluster's queue, in-flight,
pending and heartbeat figures in one round trip (:meth:`Clusters.clusters`), records observed
lengths for the predictor's retraining, and opens a cluster's wake channel. The ``*_commands``
methods return the commands instead of running them, for the worker's one-round-trip tick
(:mod:`workqueue.worker_tick`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence

from workqueue import keys
from workqueue.core import QueueCore
from workqueue.length_stats import increments
from workqueue.lua_queue import LIBRARY
from workqueue.records import ClusterInfo, Observation, as_float, as_int, as_opt_int
from workqueue.script_call import Command, Op, ScriptCall, execute
from workqueue.wake import WakeListener

__all__ = ["Clusters"]


#: how long a write of observed lengths is remembered under its call's id (a resend comes within seconds)
OBSERVED_CALL_KEEP_S = 120

# KEYS: the observed list, the call's mark (keys.observed_call), the length model's statistics (keys.length_stats).
# ARGV: cap, seconds the mark is kept, the number of rows, the rows, then (field, increment) pairs of the statistics.
# Appends the rows (keeping the newest `cap`) and adds the increments, once per call: the same call sent again
# (its reply lost) adds nothing.
OBSERVE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end  -- a mark, not a lease: one script sets and reads it
redis.call('SET', KEYS[2], '1', 'EX', tonumber(ARGV[2]))
local last = 3 + tonumber(ARGV[3])
for i = 4, last, 1000 do redis.call('RPUSH', KEYS[1], unpack(ARGV, i, math.min(i + 999, last))) end
if last > 3 then redis.call('LTRIM', KEYS[1], -tonumber(ARGV[1]), -1) end
for i = last + 1, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[3], ARGV[i], ARGV[i + 1]) end
return last - 3
"""


# KEYS: the cluster's hash. ARGV: the notice's seconds. The cluster is draining (the offloader moves its queue away)
# under a preemption notice that ends at Redis time + seconds (keys.NOTICE_UNTIL: it claims nothing from now on);
# returns how many seconds are left of it (an earlier notice that ends sooner is kept).
NOTICE = LIBRARY.script(
    r"""
local until_ = server_now() + tonumber(ARGV[1])
local before = tonumber(redis.call('HGET', KEYS[1], F_NOTICE_UNTIL) or '')
if before and before < until_ then until_ = before end
redis.call('HSET', KEYS[1], 'state', 'draining', F_NOTICE_UNTIL, tostring(until_))
return tostring(until_ - server_now())
"""
)

# KEYS: the cluster's hash. Returns {state ('' if none), seconds left of its preemption notice ('' if none)}.
STATE = LIBRARY.script(
    r"""
local h = redis.call('HMGET', KEYS[1], 'state', F_NOTICE_UNTIL)
local left = ''
if h[2] then left = tostring(tonumber(h[2]) - server_now()) end
return {h[1] or '', left}
"""
)


def parse_state(reply: Sequence) -> tuple[str, float | None]:
    """A :meth:`Clusters.state_call`'s reply: the cluster's state (``active`` when unset) and the seconds left of its
    preemption notice (None: no notice; 0 or less: it ended)."""
    state, left = reply
    return state or "active", (float(left) if left else None)


class Clusters:
    """The clusters and their workers' heartbeats on ``core``'s Redis (``core.clock`` stamps heartbeats)."""

    def __init__(self, core: QueueCore) -> None:
        self.core = core
        self.r = core.r
        self._observe = core.script(OBSERVE)
        self._notice = core.script(NOTICE)
        self._state = core.script(STATE)

    def register_cluster(
        self,
        name: str,
        *,
        capacity_hint_tps: float | None = None,
        plan_tps: float | None = None,
        backend: str | None = None,
        max_query_tokens: int | None = None,
        kv_budget_tokens: int | None = None,
        state: str | None = None,
    ) -> None:
        pipe = self.r.pipeline(transaction=True)
        for op in self.register_commands(
            name,
            capacity_hint_tps=capacity_hint_tps,
            plan_tps=plan_tps,
            backend=backend,
            max_query_tokens=max_query_tokens,
            kv_budget_tokens=kv_budget_tokens,
            state=state,
        ):
            op.queue(pipe)
        pipe.execute()

    def register_commands(self, name: str, **fields: float | int | str | None) -> list[Command]:
        """The commands of :meth:`register_cluster` (fields left None are not written)."""
        if not name or ":" in name:
            raise ValueError(f"bad cluster name {name!r}: must be non-empty and contain no ':'")
        mapping = {k: v for k, v in fields.items() if v is not None}
        ops = [
            Command("sadd", keys.CLUSTERS, name),
            Command("hsetnx", keys.cluster_info(name), "state", "active"),
        ]
        if mapping:
            ops.append(Command("hset", keys.cluster_info(name), mapping=mapping))
        if mapping.get("state") == "active":  # active again: a preemption notice is over
            ops.append(Command("hdel", keys.cluster_info(name), keys.NOTICE_UNTIL))
        return ops

    def set_cluster_state(self, name: str, state: str) -> None:
        if state not in ("active", "draining", "removed"):
            raise ValueError(f"unknown cluster state {state!r}")
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.cluster_info(name), "state", state)
        if state == "active":  # active again: a preemption notice is over
            pipe.hdel(keys.cluster_info(name), keys.NOTICE_UNTIL)
        pipe.execute()

    def give_notice(self, name: str, notice_s: float) -> float:
        """Preempt cluster ``name`` with ``notice_s`` seconds of notice: it is draining (its queue is moved away)
        and claims nothing more; its workers finish what ends within the notice and checkpoint the rest
        (:mod:`workqueue.partial`). Returns the seconds left of the notice (an earlier, shorter one is kept)."""
        if not notice_s >= 0:
            raise ValueError(f"a notice must be >= 0 seconds, not {notice_s}")
        return float(self._notice(keys=[keys.cluster_info(name)], args=[float(notice_s)]))

    def state_call(self, name: str) -> ScriptCall:
        """The read of a cluster's state and of what is left of its preemption notice, as one script call (the
        worker's tick): its reply reads with :func:`parse_state`."""
        return ScriptCall(self._state, [keys.cluster_info(name)], [])

    def cluster_state(self, name: str) -> str:
        """``active``, ``draining`` or ``removed`` (``active`` for a cluster never configured)."""
        return self.r.hget(keys.cluster_info(name), "state") or "active"

    def cluster_names(self) -> list[str]:
        return sorted(self.r.smembers(keys.CLUSTERS))

    def heartbeat(self, name: str, ttl_s: float, **fields: float | int | str) -> None:
        """Publish a worker's heartbeat; the cluster counts as alive until ``ttl_s`` passes without one."""
        pipe = self.r.pipeline(transaction=True)
        for op in self.heartbeat_commands(name, ttl_s, **fields):
            op.queue(pipe)
        pipe.execute()

    def heartbeat_commands(self, name: str, ttl_s: float, **fields: float | int | str) -> list[Command]:
        """The commands of :meth:`heartbeat`."""
        now = self.core.clock()
        return [
            Command("sadd", keys.CLUSTERS, name),
            Command("hsetnx", keys.cluster_info(name), "state", "active"),
            Command("hset", keys.cluster_info(name), "last_seen", now),
            Command("hset", keys.heartbeat(name), mapping={"ts": now, **fields}),
            Command("pexpire", keys.heartbeat(name), max(1, int(ttl_s * 1000))),
        ]

    def clusters(self, names: Iterable[str] | None = None) -> list[ClusterInfo]:
        names = list(names) if names is not None else self.cluster_names()
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.cluster_info(n))
            pipe.hgetall(keys.heartbeat(n))
            pipe.zcard(keys.queue(n))
            pipe.zcard(keys.inflight(n))
            pipe.get(keys.pending(n))
            pipe.hgetall(keys.cluster_stats(n))
        raw = pipe.execute()
        out = []
        for i, n in enumerate(names):
            info, hb, qlen, infl, pend, stats = raw[i * 6 : i * 6 + 6]
            out.append(
                ClusterInfo(
                    name=n,
                    state=info.get("state", "active"),
                    backend=hb.get("backend") or info.get("backend", ""),
                    capacity_hint_tps=as_float(info.get("capacity_hint_tps") or hb.get("capacity_hint_tps")),
                    plan_tps=as_float(info.get("plan_tps") or hb.get("plan_tps")),
                    max_query_tokens=as_int(info.get("max_query_tokens") or hb.get("max_query_tokens")),
                    kv_budget_tokens=as_int(info.get("kv_budget_tokens") or hb.get("kv_total_tokens")),
                    alive=bool(hb),
                    last_heartbeat=as_float(hb.get("ts") or info.get("last_seen")),
                    measured_tps=as_float(hb.get("tokens_per_s")),
                    running=as_int(hb.get("running")),
                    waiting=as_int(hb.get("waiting")),
                    kv_used_tokens=as_int(hb.get("kv_used_tokens")),
                    kv_total_tokens=as_int(hb.get("kv_total_tokens")),
                    kv_step_tokens=as_int(hb.get("kv_step_tokens")),
                    kv_token_seconds=as_float(hb.get("kv_token_seconds")),
                    device_steps=as_int(hb.get("device_steps")),
                    device_overrun_steps=as_int(hb.get("device_overrun_steps")),
                    device_busy_s=as_float(hb.get("device_busy_s"), None),
                    steps=as_opt_int(hb.get("steps")),
                    redis_round_trips=as_opt_int(hb.get("redis_round_trips")),
                    running_remaining_tokens=as_float(hb.get("running_remaining_tokens")),
                    queue_length=int(qlen),
                    inflight=int(infl),
                    pending_tokens=max(0.0, as_float(pend)),
                    assigned_predicted_tokens=as_float(stats.get("assigned_predicted_tokens")),
                    finished_predicted_tokens=as_float(stats.get("finished_predicted_tokens")),
                    finished_actual_tokens=as_int(stats.get("finished_actual_tokens")),
                    finished_total_tokens=as_int(stats.get("finished_total_tokens")),
                    finished_queries=as_int(stats.get("finished_queries")),
                    served_model=info.get("served_model"),
                    openai_fields=info.get("openai_fields"),
                    length_model=info.get("length_model"),
                )
            )
        return out

    def record_observed(
        self, rows: Sequence[Observation | Mapping], cap: int = 1_000_000, length_model: str = ""
    ) -> None:
        """Append observed (prompt, length) records for predictor retraining; keeps the newest ``cap``.

        Each row is an :class:`Observation` (or a mapping, written as it is). With ``length_model``, the
        rows' (predicted, length) pairs are added to that model's statistics (:mod:`workqueue.length_stats`)."""
        if rows:
            execute(self.r, self.observed_commands(rows, cap, uuid.uuid4().hex, length_model))

    def observed_commands(
        self,
        rows: Sequence[Observation | Mapping],
        cap: int = 1_000_000,
        call: str = "",
        length_model: str = "",
    ) -> list[Op]:
        """The commands of :meth:`record_observed` (``rows`` not empty): one OBSERVE call that appends them once
        however often it is sent under the same ``call`` id (a worker's tick: :mod:`workqueue.worker_tick`).
        Rows with ``retrain`` false only add to ``length_model``'s statistics."""
        obs = [r if isinstance(r, Observation) else None for r in rows]
        kept = [
            r.to_json() if o is not None else json.dumps(dict(r))
            for r, o in zip(rows, obs, strict=True)
            if o is None or o.retrain
        ]
        pairs = [(o.predicted or 0.0, o.length) for o in obs if o is not None] if length_model else []
        stats = [x for kv in increments(pairs).items() for x in kv]
        return [
            ScriptCall(
                self._observe,
                [
                    keys.OBSERVED,
                    keys.observed_call(call or uuid.uuid4().hex),
                    keys.length_stats(length_model),
                ],
                [cap, OBSERVED_CALL_KEEP_S, len(kept), *kept, *stats],
            )
        ]

    def wake_listener(self, cluster: str) -> WakeListener:
        """A subscription that ends an idle worker's wait when queries land in ``cluster``'s queue."""
        return WakeListener(self.r, cluster)
