"""A worker's queue work for one tick, in one round trip to Redis.

An engine in one cloud may reach the queue's Redis in another, 20-150 ms away, so its queue
agent (:mod:`engines.queue_agent`) asks for everything a tick needs at once: register the
cluster, write finished results, record observed lengths, renew its leases, requeue lapsed
ones, checkpoint the queries it runs (their partial outputs: :mod:`workqueue.partial`; a preempted
worker gives them back with the same call), claim new queries, read its batches' statuses (cancels)
and its cluster's state (removal, a preemption notice), and publish its heartbeat. :meth:`TickRequest` lists what to do; :func:`run_tick`
sends it as one pipeline (:func:`workqueue.script_call.execute`: two round trips only when
Redis lost its scripts) and reads the replies into a :class:`TickReply`.

The pipeline is not a transaction: every part is the same script or command the queue runs
alone (:mod:`workqueue.leases`), in this order, with the same guarantees (write-once
results, leases on Redis time). Renewals come before the claim, so queries of this worker
that were requeued after an outage come back to it instead of being handed out again; and a
tick that renews passes the same ids to its claim, whose script takes them back before it
pops, so this holds even when Redis refused the RENEW calls (``NOSCRIPT``: a Redis that lost
its scripts, where another worker loaded CLAIM again first) and ran the claim before they
were sent again. Renewals fall due once every ``renew_every_s``, so most claims carry none.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from workqueue import keys
from workqueue.clusters import parse_state
from workqueue.leases import RENEW_CHUNK
from workqueue.partial import Partial
from workqueue.queue import WorkQueue
from workqueue.records import ClaimedQuery, Observation, QueryResult, QueryState
from workqueue.script_call import Command, Op, execute


@dataclass
class Finished:
    """A result to write: the query's gid, its record, its final state and its actual tokens."""

    gid: str
    result: QueryResult
    kind: QueryState
    actual_tokens: int


@dataclass
class TickRequest:
    cluster: str
    worker_id: str
    lease_s: float
    register: Mapping[str, float | int | str | None] | None = None  # fields of the cluster's registration
    results: list[Finished] = field(default_factory=list)
    observed: list[Observation] = field(default_factory=list)
    # the id its observed lengths are written once under (a new one when empty): the agent keeps one until they are
    # written, so a tick sent again, by redis-py after a lost reply or by the agent after a failed tick, adds none twice
    observed_call: str = ""
    # the key the observed rows' (predicted, length) pairs add to (workqueue.length_stats)
    length_model: str = ""
    renew: list[str] | None = None  # gids whose leases to renew (None: none this tick)
    # (gid, partial output or None, release): checkpoints to write, and queries to give back without using an attempt
    checkpoints: list[tuple[str, Partial | None, bool]] = field(default_factory=list)
    requeue: bool = False  # requeue the cluster's lapsed leases
    claim: int = 0  # queries to claim
    batches: list[str] = field(default_factory=list)  # batches whose status to read
    read_state: bool = True  # read the cluster's state (active, draining, removed)
    heartbeat: Mapping[str, float | int | str] | None = None
    heartbeat_ttl_s: float = 5.0


class PendingObservations:
    """A worker's observed lengths waiting for a tick. Those a tick sent go out again, with the same call id and
    nothing added, until a tick writes them (:meth:`written`): so they are recorded once however often sent."""

    def __init__(self) -> None:
        self.rows: list[Observation] = []
        self._call, self._sent = "", 0

    def append(self, row: Observation) -> None:
        self.rows.append(row)

    def for_tick(self) -> tuple[list[Observation], str]:
        """The rows to send, and their call id (:attr:`TickRequest.observed_call`)."""
        if not self._sent:
            self._call, self._sent = uuid.uuid4().hex, len(self.rows)
        return self.rows[: self._sent], self._call

    def written(self, n: int) -> None:
        """A tick wrote the first ``n`` rows."""
        del self.rows[:n]
        self._sent = 0


@dataclass
class TickReply:
    # per result: its index, -1 if it already had one, RESENT if this write recorded it (workqueue.scripts)
    written: list[int] = field(default_factory=list)
    renewed: int = 0
    requeued: int = 0
    claimed: list[ClaimedQuery] = field(default_factory=list)
    statuses: dict[str, str | None] = field(default_factory=dict)
    state: str | None = None
    # seconds left of the cluster's preemption notice (None: none, or not read)
    notice_left_s: float | None = None
    # per checkpoint: written (the worker held the query)
    checkpointed: list[bool] = field(default_factory=list)
    released: int = 0  # queries the checkpoints gave back (and lapsed leases requeued with them)


def build(queue: WorkQueue, req: TickRequest, now: float) -> tuple[list[Op], dict[str, slice]]:
    """The tick's commands, and which replies belong to which part."""
    ops: list[Op] = []
    parts: dict[str, slice] = {}

    def part(name: str, new: list[Op]) -> None:
        parts[name] = slice(len(ops), len(ops) + len(new))
        ops.extend(new)

    if req.register is not None:
        part("register", queue.register_commands(req.cluster, **req.register))
    part("results", [queue.complete_call(f.gid, f.result, f.kind, f.actual_tokens) for f in req.results])
    if req.observed:
        part(
            "observed",
            queue.observed_commands(
                req.observed, call=req.observed_call or uuid.uuid4().hex, length_model=req.length_model
            ),
        )
    if req.renew:
        part("renew", list(queue.renew_calls(req.cluster, req.renew, req.lease_s, req.worker_id)))
    if req.checkpoints:  # after the results: a query finished in this tick has no hash left to write to
        part("checkpoint", [queue.checkpoint_call(req.cluster, req.worker_id, req.checkpoints)])
    if req.requeue:
        part("requeue", [queue.requeue_call(req.cluster)])
    if req.claim > 0:  # it carries the tick's renewals (one RENEW call's worth): see the module's docstring
        renew = list(req.renew or ())[:RENEW_CHUNK]
        part("claim", [queue.claim_call(req.cluster, req.claim, req.worker_id, req.lease_s, now, renew)])
    part("statuses", [Command("hget", keys.batch(b), "status") for b in req.batches])
    if req.read_state:
        part("state", [queue.state_call(req.cluster)])
    if req.heartbeat is not None:
        part("heartbeat", queue.heartbeat_commands(req.cluster, req.heartbeat_ttl_s, **req.heartbeat))
    return ops, parts


def run_tick(queue: WorkQueue, req: TickRequest) -> TickReply:
    """Do ``req`` in one round trip (see the module's docstring); Redis errors propagate."""
    now = queue.clock()
    ops, parts = build(queue, req, now)
    replies = execute(queue.r, ops)
    reply = TickReply()
    reply.written = [int(x) for x in replies[parts["results"]]]
    if "renew" in parts:
        reply.renewed = sum(int(x) for x in replies[parts["renew"]])
    if "requeue" in parts:
        reply.requeued = int(replies[parts["requeue"]][0])
    if "claim" in parts:
        reply.claimed = queue.parse_claim(req.cluster, replies[parts["claim"]][0], now)
    reply.statuses = dict(zip(req.batches, replies[parts["statuses"]], strict=True))
    if "checkpoint" in parts:
        released, *written = replies[parts["checkpoint"]][0]
        reply.released, reply.checkpointed = int(released), [bool(int(x)) for x in written]
    if "state" in parts:
        reply.state, reply.notice_left_s = parse_state(replies[parts["state"]][0])
    return reply
