"""Round trips to Redis per gateway tick: ``python -m load.reports.roundtrips`` prints a table, then one JSON line.

Counted with :func:`workqueue.roundtrips.count_round_trips` (a command or a whole pipeline is
one) on an embedded Redis, each figure after a warm-up (scripts loaded, connections open):

* ``submit``: one ``SubmitBatch`` of a large batch (background intake) through the servicer;
* ``intake``: its background intake, in all and per chunk (3 live clusters);
* ``offloader_steady``: one offloader tick with K busy clusters (nothing to move);
* ``offloader_offload``: one tick with one busy cluster and K-1 idle ones that each take work;
* ``cluster_status``: ``ListClusters`` / ``fleetbatch gateway status`` with K clusters;
* ``get_batch``: ``GetBatch`` of one batch; ``list_batches``: the HTTP ``GET /v1/batches`` page
  of B batches; ``quota``: a submission's per-client cap check over B unfinished batches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from gateway.assign.listing import read_clusters
from gateway.batches import quota
from gateway.batches.errors import Caller
from gateway.batches.service import BatchService
from gateway.config import ClusterSpec, GatewayConfig
from gateway.grpc_api.auth import HTTP_CLIENT
from gateway.http_api import batches as ob
from gateway.offload.offloader import Offloader
from protos import fleetbatch_pb2 as pb
from workqueue import QueuedQuery, WorkQueue, connect
from workqueue.embedded import EmbeddedRedis
from workqueue.records import BatchState
from workqueue.roundtrips import count_round_trips

LIVE = ("fast", "medium", "slow")


def _fresh(url: str) -> WorkQueue:
    q = WorkQueue(connect(url))
    q.r.flushdb()
    return q


def _counted(url: str) -> tuple[WorkQueue, object]:
    q = WorkQueue(connect(url))
    trips = count_round_trips(q.r)
    q.r.ping()
    return q, trips


def _since(trips, before: int) -> int:
    return trips.value - before


def _alive(q: WorkQueue, names, capacity: float = 100.0) -> None:
    for n in names:
        q.register_cluster(n, capacity_hint_tps=capacity)
        q.heartbeat(n, 600, tokens_per_s=capacity, running=0)


def _queued(q: WorkQueue, batch_id: str, cluster: str, n: int) -> None:
    rows = [(QueuedQuery(batch_id, f"q{i}", "p", 200, 10, 100.0), cluster) for i in range(n)]
    q.create_batch(batch_id, rows)


def offloader_tick(url: str, k: int, offload: bool) -> int:
    """Round trips of one offloader tick with ``k`` clusters: all busy, or one busy and the rest idle."""
    names = [f"c{i}" for i in range(k)]
    setup = _fresh(url)
    _alive(setup, names)
    for i, n in enumerate(names if not offload else names[:1]):
        _queued(setup, f"b{i}", n, 300 * k if offload else 5)
    q, trips = _counted(url)
    Offloader(q).tick()  # warm-up: scripts loaded (it moves nothing twice: a fresh state follows)
    setup.r.flushdb()
    _alive(setup, names)
    for i, n in enumerate(names if not offload else names[:1]):
        _queued(setup, f"b{i}", n, 300 * k if offload else 5)
    off, before = Offloader(q), trips.value
    moved = off.tick()
    if offload and moved < k - 1:
        raise RuntimeError(f"the offload tick moved {moved} queries, fewer than the {k - 1} idle clusters")
    return _since(trips, before)


def cluster_status(url: str, k: int) -> int:
    setup = _fresh(url)
    _alive(setup, [f"c{i}" for i in range(k)])
    q, trips = _counted(url)
    read_clusters(q, listed=True)
    before = trips.value
    read_clusters(q, listed=True)
    return _since(trips, before)


def _batches(url: str, b: int, client: str = "") -> WorkQueue:
    setup = _fresh(url)
    _alive(setup, ["c0"])
    for i in range(b):
        bid = f"h{i}"
        _queued(setup, bid, "c0", 2)
        ob.create_record(setup, bid, "file-x", "/v1/chat/completions", "24h")
        if client:
            setup.r.sadd(quota.client_key(client), bid)
    return setup


def list_batches(url: str, b: int) -> int:
    """The HTTP listing's Redis work for a page of ``b`` batches (what ``GET /v1/batches`` reads)."""
    _batches(url, b)
    q, trips = _counted(url)
    page = getattr(ob, "batch_objects", None)

    def read() -> None:
        ids, _ = ob.list_batches(q, b, None)
        if page is not None:
            page(q, ids, HTTP_CLIENT)
            return
        for bid in ids:  # the code before batch_objects: one batch at a time
            info = q.batch(bid)
            rec = q.r.hgetall(ob.record_key(bid))
            quota.may_see(q, bid, HTTP_CLIENT)
            ob.note_progress(q, bid, info, rec)

    read()
    before = trips.value
    read()
    return _since(trips, before)


def quota_check(url: str, b: int) -> int:
    _batches(url, b, client="alice")
    q, trips = _counted(url)
    quota.unfinished(q, "alice")
    before = trips.value
    quota.unfinished(q, "alice")
    return _since(trips, before)


async def _submit_and_intake(url: str, n: int) -> dict:
    from gateway.server import build_deps

    _fresh(url)
    config = GatewayConfig(
        redis_url=url, offload=False, clusters=[ClusterSpec(c, capacity_tps=100) for c in LIVE]
    )
    deps = await asyncio.to_thread(build_deps, config)
    _alive(deps.queue, LIVE)
    service = BatchService(deps)
    trips = count_round_trips(deps.queue.r)
    chunks = [0]
    land = service.intake._land

    def counted_land(*a):
        chunks[0] += 1
        return land(*a)

    service.intake._land = counted_land
    out = {}
    for label, m in (("warmup", 3000), ("submit", n)):
        req = pb.SubmitBatchRequest(batch_id=label)
        for i in range(m):
            req.queries.add(id=f"q{i}", prompt=f"Explain item {i} " + "word " * (i % 7), max_tokens=16)
        before = trips.value
        batch = (await service.submit(req, Caller(owner=None))).info
        out[label] = _since(trips, before)
        if batch.status != BatchState.VALIDATING:
            raise RuntimeError(f"{label}: a {m}-query batch was not accepted for background intake")
        before, chunks[0] = trips.value, 0
        while await asyncio.to_thread(service.intake.tick):
            pass
        out[f"{label}_intake"], out[f"{label}_chunks"] = _since(trips, before), chunks[0]
    before = trips.value
    await service.get("submit", Caller(owner=None))
    out["get_batch"] = _since(trips, before)
    return {
        "get_batch": out["get_batch"],
        "submit": out["submit"],
        "intake": out["submit_intake"],
        "intake_chunks": out["submit_chunks"],
        "intake_per_chunk": round(out["submit_intake"] / max(1, out["submit_chunks"]), 2),
    }


def measure(url: str, clusters: list[int], batches: list[int], n: int) -> dict:
    out: dict = {"queries": n}
    out.update(asyncio.run(_submit_and_intake(url, n)))
    out["offloader_steady"] = {k: offloader_tick(url, k, offload=False) for k in clusters}
    out["offloader_offload"] = {k: offloader_tick(url, k, offload=True) for k in clusters}
    out["cluster_status"] = {k: cluster_status(url, k) for k in clusters}
    out["list_batches"] = {b: list_batches(url, b) for b in batches}
    out["quota"] = {b: quota_check(url, b) for b in batches}
    return out


def table(m: dict) -> str:
    lines = [f"GetBatch: {m['get_batch']} round trips",
             f"SubmitBatch of {m['queries']} queries: {m['submit']} round trips",
             f"its background intake: {m['intake']} in {m['intake_chunks']} chunks "
             f"({m['intake_per_chunk']} per chunk)"]  # fmt: skip
    for what in ("offloader_steady", "offloader_offload", "cluster_status", "list_batches", "quota"):
        lines.append(f"{what}: " + ", ".join(f"{k} -> {v}" for k, v in m[what].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m load.reports.roundtrips", description=__doc__.splitlines()[0])
    p.add_argument("-n", "--num-queries", type=int, default=20_000, help="queries in the submitted batch")
    p.add_argument("--num-clusters", type=int, nargs="+", default=[3, 6, 12], help="cluster counts")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 10, 50], help="batch counts")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fleetbatch-rt-") as tmp:
        with EmbeddedRedis(Path(tmp) / "redis", persist=False) as server:
            m = measure(server.url, args.num_clusters, args.batches, args.num_queries)
    print(table(m), file=sys.stderr)
    print(json.dumps(m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
