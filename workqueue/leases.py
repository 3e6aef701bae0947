"""The worker side of the queue: claims under leases, renewal, requeue of lapsed leases, results.

A worker *claims* queries: they move from the cluster's queue into its in-flight set, scored
by a lease deadline. Deadlines are **Redis time** (``TIME`` inside the scripts) plus the
lease length, and expiry is checked against Redis time too, so skewed client clocks neither
expire a live lease nor keep a dead one. The worker renews its leases while it works and
*completes* each query once; a second completion of the same query id is ignored.

A worker's claim carries its renewals (:meth:`Leases.claim` ``renew``): when a Redis outage
outlasted its leases and the requeue ran before it could renew, its queries come back to it
rather than being handed to it (or another worker) as new work.

A worker that dies stops renewing; :meth:`Leases.requeue_expired` puts the queries whose
lease lapsed back in their queue, at their place in the order. A worker that was only slow may still
complete such a query: the completion counts (it is the first result) and *reconciles* the
queue, taking the requeued id out of its queue and its tokens out of the cluster's
``pending`` counter.

**max_attempts** (default 3; ``None`` or 0: no limit) bounds how often one query is run.
A lapsed lease (or one given back by :meth:`Leases.release`) always goes back to the queue;
the check is in the claim: a query popped after it already had ``max_attempts`` claims is
not handed out but finished as ``failed``, with a result whose ``finish_reason`` is ``error``
and whose ``error`` says it failed that many times. It counts in its batch's ``failed``
count and the rest of the batch goes on. Deciding there (rather than when the lease lapses)
lets a worker that is alive take back its query on its last attempt after a Redis outage
outlasted the lease: its claim's or its agent's renewal reasserts the query before anyone
pops it, so its real result is written; a worker that really died never comes back, and the
next claim, on this cluster or on the one the query was moved to, fails it. Until then the
query is queued like any other (in its queue, its cluster's ``pending`` counter, movable).
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Iterable, Mapping

from workqueue import keys, scripts
from workqueue.core import QueueCore
from workqueue.partial import Partial
from workqueue.records import FINAL_QUERY_STATES, ClaimedQuery, QueryResult, QueryState, QueuedQuery, as_float
from workqueue.script_call import ScriptCall

log = logging.getLogger(__name__)

RENEW_CHUNK = 1000  # gids per RENEW call (one script call stays short)
#: how long a CLAIM's reply is kept for the same call sent again (a resend comes within the clients' retries)
CLAIM_REPLY_S = 120


class Leases:
    """Claims, leases and results on ``core``'s Redis: ``core.max_attempts`` bounds the claims a query
    gets, ``core.clock`` stamps claims and results (lease deadlines are Redis time). The ``*_call``
    methods return a script's call instead of running it, for the worker's one-round-trip tick
    (:mod:`workqueue.worker_tick`), and :meth:`parse_claim` reads a CLAIM's reply."""

    def __init__(self, core: QueueCore) -> None:
        self.core = core
        self.r = core.r
        self._complete = core.script(scripts.COMPLETE)
        self._claim = core.script(scripts.CLAIM)
        self._renew = core.script(scripts.RENEW)
        self._requeue = core.script(scripts.REQUEUE_EXPIRED)
        self._release = core.script(scripts.RELEASE)
        self._checkpoint = core.script(scripts.CHECKPOINT)

    @property
    def max_attempts(self) -> int:
        """Claims a query gets (0: no limit)."""
        return self.core.max_attempts

    def claim(
        self, cluster: str, n: int, worker_id: str, lease_s: float, renew: Iterable[str] = ()
    ) -> list[ClaimedQuery]:
        """Take up to ``n`` queries from the head of the cluster's queue under a lease of
        ``lease_s`` seconds of Redis time (zero or less: already lapsed).

        ``renew``: the gids the worker runs. In the same script, before it pops anything, their
        leases are renewed and those of them requeued after their lease lapsed come back to the
        worker (as :meth:`renew` with ``worker_id`` does), so it is never handed one of them."""
        renew = list(renew)
        if n <= 0 and not renew:
            return []
        now = self.core.clock()
        call = self.claim_call(cluster, n, worker_id, lease_s, now, renew)
        return self.parse_claim(cluster, call.run(), now)

    def claim_call(
        self, cluster: str, n: int, worker_id: str, lease_s: float, now: float, renew: Iterable[str] = ()
    ) -> ScriptCall:
        """The CLAIM script's call (:meth:`claim`), to run alone or in a pipeline (the worker's tick). The call
        has an id of its own: sent again after its reply was lost, it answers the first run's reply."""
        reply = keys.claim_reply(cluster, uuid.uuid4().hex)
        return ScriptCall(
            self._claim,
            [keys.queue(cluster), keys.inflight(cluster), keys.pending(cluster), reply],
            [cluster, max(0, n), float(lease_s), worker_id, now, self.max_attempts, CLAIM_REPLY_S, *renew],
        )

    def parse_claim(self, cluster: str, reply: list, now: float) -> list[ClaimedQuery]:
        """The queries a CLAIM's ``reply`` hands out (claimed at ``now``); logs those it failed."""
        gave_up, *flat = reply
        if int(gave_up):
            log.warning(
                "%s: %d queries failed: each had used its %d attempts (their workers died or lost their leases)",
                cluster,
                int(gave_up),
                self.max_attempts,
            )
        out = []
        for i in range(0, len(flat), scripts.CLAIMED_FIELDS):
            _, payload, attempts, enqueued_at, partial = flat[i : i + scripts.CLAIMED_FIELDS]
            query = QueuedQuery(**json.loads(payload))
            out.append(
                ClaimedQuery(query, int(attempts), as_float(enqueued_at), now, Partial.decode(partial))
            )
        return out

    def checkpoint_call(
        self, cluster: str, worker_id: str, items: Iterable[tuple[str, Partial | None, bool]]
    ) -> ScriptCall:
        """The CHECKPOINT script's call: per ``(gid, partial, release)`` the partial output is written (None:
        nothing to write) while ``worker_id`` holds the query, and with ``release`` the query goes back to the
        queue without using an attempt (:mod:`workqueue.scripts`). Its reply: ``[requeued, written per item...]``."""
        args: list = [cluster, worker_id]
        for gid, partial, release in items:
            args += [gid, "1" if release else "0", partial.encode() if partial else ""]
        return ScriptCall(
            self._checkpoint, [keys.inflight(cluster), keys.queue(cluster), keys.pending(cluster)], args
        )

    def checkpoint(
        self, cluster: str, worker_id: str, items: Iterable[tuple[str, Partial | None, bool]]
    ) -> list[bool]:
        """Run :meth:`checkpoint_call` alone; per item whether it was written (the worker held the query)."""
        items = list(items)
        if not items:
            return []
        return [bool(int(x)) for x in self.checkpoint_call(cluster, worker_id, items).run()[1:]]

    def renew(self, cluster: str, gids: Iterable[str], lease_s: float, worker_id: str = "") -> int:
        """Extend the leases of those ``gids`` still in flight on ``cluster`` to Redis time +
        ``lease_s``; returns how many it extended (ids finished meanwhile are left alone).

        With ``worker_id``, only the leases that worker holds, and those of its queries that were
        requeued after their lease lapsed (a Redis outage longer than the lease) and that nobody
        claimed since come back to it, out of the queue, with no new attempt. Without, ids requeued
        meanwhile are left alone."""
        return sum(int(call.run()) for call in self.renew_calls(cluster, gids, lease_s, worker_id))

    def renew_calls(
        self, cluster: str, gids: Iterable[str], lease_s: float, worker_id: str = ""
    ) -> list[ScriptCall]:
        """The RENEW script's calls for ``gids`` (:meth:`renew`), :data:`RENEW_CHUNK` gids each."""
        gids = list(gids)
        ks = [keys.inflight(cluster), keys.queue(cluster), keys.pending(cluster)]
        return [
            ScriptCall(self._renew, ks, [cluster, float(lease_s), worker_id, *gids[i : i + RENEW_CHUNK]])
            for i in range(0, len(gids), RENEW_CHUNK)
        ]

    def release(self, cluster: str, gids: Iterable[str], *, worker: str, started: bool = True) -> int:
        """Give claimed queries back now (their worker cannot finish them): their leases end and they
        return to the queue at their place, as a lapsed lease would make them (one that used its last
        attempt fails at its next claim). Only the queries ``worker`` still runs go back: one another
        worker took over after this one's lease lapsed, or one already finished, is left alone.
        ``started=False``: the worker never ran them (it claimed them ahead), so their claim's attempt is
        taken back. Returns how many were requeued."""
        gids = list(gids)
        if not gids:
            return 0
        keys_ = [keys.inflight(cluster), keys.queue(cluster), keys.pending(cluster)]
        return int(self._release(keys=keys_, args=[cluster, worker, "1" if started else "0", *gids]))

    def requeue_expired(self, cluster: str) -> int:
        """Put queries whose lease lapsed (in Redis time) back in the queue at their rank (those that used
        their ``max_attempts`` fail at their next claim). Returns how many were requeued."""
        return int(self.requeue_call(cluster).run())

    def requeue_call(self, cluster: str) -> ScriptCall:
        """The REQUEUE_EXPIRED script's call (:meth:`requeue_expired`)."""
        return ScriptCall(
            self._requeue, [keys.inflight(cluster), keys.queue(cluster), keys.pending(cluster)], [cluster]
        )

    def complete(
        self,
        gid: str,
        result: QueryResult | Mapping,
        kind: QueryState | str = QueryState.COMPLETED,
        actual_tokens: int = 0,
    ) -> int:
        """Write a query's result once. Returns its index in the batch's results, -1 if it already had one, or
        :data:`~workqueue.scripts.RESENT` if this very write recorded it (sent again after its reply was lost).

        ``result`` is a :class:`QueryResult` (or a mapping, written as it is); ``kind`` one of
        :data:`FINAL_QUERY_STATES`. A completion that comes after the query's lease lapsed and it
        was requeued still counts (when first) and takes the query back out of its queue."""
        return int(self.complete_call(gid, result, kind, actual_tokens).run())

    def complete_call(
        self,
        gid: str,
        result: QueryResult | Mapping,
        kind: QueryState | str = QueryState.COMPLETED,
        actual_tokens: int = 0,
    ) -> ScriptCall:
        """The COMPLETE script's call (:meth:`complete`)."""
        if kind not in FINAL_QUERY_STATES:
            raise ValueError(f"kind must be one of {', '.join(sorted(FINAL_QUERY_STATES))}, not {kind!r}")
        if isinstance(result, QueryResult):
            row, prompt = result.to_json(), result.prompt_tokens
        else:
            row, prompt = json.dumps(dict(result)), result.get("prompt_tokens") or 0
        write_id = hashlib.sha1(f"{gid}\0{kind}\0{row}".encode()).hexdigest()[
            :16
        ]  # the same write resent: the same id
        return ScriptCall(
            self._complete,
            [keys.query(gid), keys.batch(keys.split_gid(gid)[0]), keys.result_write(gid)],
            [gid, row, str(kind), int(actual_tokens), self.core.clock(), int(prompt or 0), write_id],
        )
