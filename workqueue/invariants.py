"""The queue's invariants, as code: what must hold whenever no script is running.

:func:`check` reads the whole key space (it is for tests, audits and ``fleetbatch gateway status
--check``-style tools, not for a hot path) and returns every violation it finds:

* every query of a batch is in exactly one place: a cluster's queue (state ``queued``), a
  cluster's in-flight set (state ``running``), or its batch's ``done`` set (it has a result);
* a queued or running query has its hash, and its hash names the cluster that holds it;
  a query with a result has no hash left (no orphan query keys);
* a batch counts ``completed + failed + cancelled`` = its ``done`` set = its result list, and
  ``total`` = done + queued + running + not yet enqueued (rows still in its intake list, for a
  batch accepted for background intake: ``intake_total - intake_done`` of them, exactly), the
  rows of a lost intake list (``intake_lost``, counted finished with no result) aside;
* a batch is in the intake set exactly while its intake is unfinished, and a batch still
  ``validating`` has nothing enqueued, nothing running and nothing done;
* each cluster's ``pending`` counter equals the predicted tokens of its queued queries (the
  tokens of running queries leave the counter when they are claimed).
"""

from __future__ import annotations

from collections import Counter

import redis

from workqueue import keys
from workqueue.batches import INTAKE, intake_key
from workqueue.intake_ops import LOST
from workqueue.records import FINAL_QUERY_STATES, BatchState, QueryState

TOLERANCE = 1e-6


def _where(r: redis.Redis) -> tuple[dict[str, list[str]], dict[str, dict[str, list[str]]]]:
    """Per gid, the places that hold it (``queue:c`` / ``inflight:c``); per cluster, its lists."""
    places: dict[str, list[str]] = {}
    clusters: dict[str, dict[str, list[str]]] = {}
    for c in sorted(r.smembers(keys.CLUSTERS)):
        queued = r.zrange(keys.queue(c), 0, -1)
        running = r.zrange(keys.inflight(c), 0, -1)
        clusters[c] = {"queued": queued, "running": running}
        for g in queued:
            places.setdefault(g, []).append(f"queue:{c}")
        for g in running:
            places.setdefault(g, []).append(f"inflight:{c}")
    return places, clusters


def _intake_problems(r: redis.Redis, b: str, h: dict[str, str], waiting: int, seen: int) -> list[str]:
    """A batch's background intake: its list holds exactly its rows not yet enqueued, and the
    intake set holds the batch exactly while some are left."""
    bad = []
    stored = r.llen(intake_key(b))
    if stored != waiting:
        bad.append(f"batch {b}: intake list has {stored} rows, {waiting} are not yet enqueued")
    listed = r.zscore(INTAKE, b) is not None
    if listed != (waiting > 0):
        bad.append(f"batch {b}: {'in' if listed else 'not in'} the intake set with {waiting} rows left")
    if h.get("status") == BatchState.VALIDATING and seen:
        bad.append(f"batch {b}: validating with {seen} queries already enqueued or finished")
    return bad


def check(r: redis.Redis) -> list[str]:
    """Every invariant violation in the Redis behind ``r`` (empty: all hold)."""
    bad: list[str] = []
    places, clusters = _where(r)
    done: dict[str, set[str]] = {}
    for b in r.zrange(keys.BATCHES, 0, -1):
        done[b] = set(r.smembers(keys.done(b)))
        h = r.hgetall(keys.batch(b))
        if "status" not in h:
            continue
        lost = int(h.get(LOST, 0) or 0)  # rows of a lost intake list: counted, never done
        finished = sum(int(h.get(k, 0) or 0) for k in FINAL_QUERY_STATES) - lost  # a count per kind
        if finished != len(done[b]):
            bad.append(f"batch {b}: counts {finished} finished, done set has {len(done[b])}")
        n_results = r.llen(keys.results(b))
        if n_results != len(done[b]):
            bad.append(f"batch {b}: {n_results} results for {len(done[b])} done queries")
        live = sum(1 for g in places if keys.split_gid(g)[0] == b)
        waiting = int(h.get("intake_total", 0) or 0) - int(h.get("intake_done", 0) or 0)
        if int(h.get("total", 0) or 0) != len(done[b]) + live + waiting + lost:
            bad.append(
                f"batch {b}: total {h.get('total')} != {len(done[b])} done + {live} queued or running"
                f" + {waiting} not yet enqueued + {lost} lost at intake"
            )
        bad += _intake_problems(r, b, h, waiting, live + len(done[b]))
    for g, where in places.items():
        b, q = keys.split_gid(g)
        if len(where) > 1:
            bad.append(f"query {g} is in {len(where)} places: {', '.join(sorted(where))}")
        if q in done.get(b, set()):
            bad.append(f"query {g} has a result and is still in {', '.join(where)}")
        h = r.hgetall(keys.query(g))
        if not h:
            bad.append(f"query {g} in {', '.join(where)} has no hash")
            continue
        kind, c = where[0].split(":", 1)
        want = QueryState.QUEUED if kind == "queue" else QueryState.RUNNING
        if h.get("state") != want or h.get("cluster") != c:
            bad.append(f"query {g} in {where[0]} has state {h.get('state')!r}, cluster {h.get('cluster')!r}")
    for key in r.scan_iter(match=keys.query("*"), count=1000):
        g = key[len(keys.query("")) :]
        if g not in places:
            bad.append(f"orphan key {key}: the query is in no queue and no in-flight set")
    for c, lists in clusters.items():
        counts = Counter(lists["queued"])
        expect = sum(float(r.hget(keys.query(g), "tokens") or 0) * n for g, n in counts.items())
        pending = float(r.get(keys.pending(c)) or 0)
        if abs(pending - expect) > TOLERANCE * max(1.0, expect):
            bad.append(f"cluster {c}: pending {pending:g} tokens, its queued queries hold {expect:g}")
    return bad
