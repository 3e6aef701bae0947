"""The HTTP front's health route, ``GET /healthz``: 200 while this replica serves and reaches the queue
store (Redis answers ``PING``), else the front's 503 for Redis down (:meth:`OpenAIFront._redis_down`).

It is public (it holds no data), so Kubernetes' ``httpGet`` readiness probe needs no key
(``k8s/base/gateway.yaml``): a replica whose Redis is gone leaves the Service until it is back.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workqueue import WorkQueue

HEALTH_PATH = "/healthz"


def health_route(queue: WorkQueue) -> Route:
    """``GET /healthz`` over ``queue``'s Redis; a Redis error propagates to the front's handlers (503)."""

    async def healthz(request: Request) -> Response:
        await asyncio.to_thread(queue.r.ping)
        return JSONResponse({"status": "ok"})

    return Route(HEALTH_PATH, healthz, methods=["GET"])
