"""The status page of the HTTP front: the fleet at a glance.

* ``GET /status``: one self-contained page (``status_page.html``: inline CSS and JavaScript, no
  library, nothing fetched from elsewhere). It holds no data, so it needs no key; it asks for the
  API key (or takes it from the URL's fragment, ``/status#key=...``, which never reaches the server)
  and keeps it in the tab's session storage.
* ``GET /v1/fleet/status``: what the page shows, as JSON, behind the same key as the rest of the
  API (401 otherwise): the clusters (alive, state, capacity, queue, running, KV in use), the newest
  batches of every client (counts, token progress, deadline, ETA, cost so far; no prompt or output), the fleet's
  throughput over the last ten minutes, its cost rate and cost so far (each cluster's price and cost too), and the
  server's time. An operator's view: whoever holds the
  HTTP key sees every batch's progress, never its contents.

The page polls the JSON every second and draws the throughput on a canvas.
"""

from __future__ import annotations

import asyncio
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from gateway.assign.listing import read_clusters
from gateway.assign.views import cluster_views
from gateway.http_api.objects import fleetbatch_fields
from gateway.status.cost import ClusterCost
from gateway.status.eta import EtaBoard
from workqueue import BatchInfo, ClusterInfo, WorkQueue

PAGE_PATH = "/status"
BATCHES = 20  # newest batches the page lists


def cluster_row(info: ClusterInfo, capacity_tps: float, cost: ClusterCost | None = None) -> dict:
    """A cluster's state, and with ``cost`` its price (dollars per hour; None: not known), whether it is billed now
    (it holds work) and what it has cost so far (:mod:`gateway.status.cost`)."""
    cost = cost or ClusterCost(None, False, 0.0)
    return {
        "name": info.name,
        "alive": info.alive,
        "state": info.state,
        "capacity_tps": round(capacity_tps, 1),
        "measured_tps": round(info.measured_tps, 1),
        "queue_length": info.queue_length,
        "running": info.running,
        "waiting": info.waiting,
        "kv_used_tokens": info.kv_used_tokens,
        "kv_total_tokens": info.kv_total_tokens,
        "finished_queries": info.finished_queries,
        "price_per_hour": cost.price_per_hour,
        "billed": cost.billed,
        "cost_dollars": round(cost.dollars, 6),
    }


def batch_row(b: BatchInfo, board: EtaBoard) -> dict:
    """A batch's counts and times, then the fields of the HTTP front's ``fleetbatch`` extension (one builder)."""
    row = {
        "id": b.batch_id,
        "status": b.status,
        "total": b.total,
        "completed": b.completed,
        "failed": b.failed,
        "cancelled": b.cancelled,
        "created_at": b.created_at,
        "completed_at": b.completed_at or None,
        "cost_dollars": round(board.cost.batch(b.batch_id) or 0.0, 6),  # so far (gateway.status.cost)
    }
    return row | (fleetbatch_fields(b, board.get(b.batch_id)) or {})


class StatusPage:
    def __init__(self, queue: WorkQueue, board: EtaBoard) -> None:
        self.queue, self.board = queue, board
        self.html = (
            resources.files("gateway.http_api").joinpath("status_page.html").read_text(encoding="utf-8")
        )

    def routes(self) -> list[Route]:
        return [
            Route(PAGE_PATH, self.page, methods=["GET"]),
            Route("/v1/fleet/status", self.status, methods=["GET"]),
        ]

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self.html, headers={"Cache-Control": "no-store"})

    async def status(self, request: Request) -> Response:
        return JSONResponse(await asyncio.to_thread(self.snapshot))

    def snapshot(self) -> dict:
        infos = read_clusters(self.queue, listed=True)
        views = cluster_views(infos)
        ids = self.queue.batch_ids(BATCHES)
        batches = [info for info, _ in self.queue.batches(ids).values() if info is not None]
        return {
            "now": self.queue.clock(),
            "clusters": [
                cluster_row(i, v.capacity_tps, self.board.cost.cluster(i.name))
                for i, v in zip(infos, views, strict=True)
            ],
            "batches": [batch_row(b, self.board) for b in batches],
            "throughput": [[round(t, 2), round(tps, 1)] for t, tps in self.board.throughput()],
            "rate_tps": round(self.board.rate_tps, 1),
            "cost_per_hour": round(self.board.cost.rate_per_hour(), 4),  # the fleet's, now
            "cost_dollars": round(self.board.cost.spent, 6),  # the fleet's, since the gateway started
        }
