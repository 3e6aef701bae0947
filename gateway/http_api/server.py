"""Run the OpenAI-compatible HTTP front (:mod:`gateway.http_api.front`) inside the gateway's event loop.

:class:`HttpServer` binds the port (``--http-port``, 0: any free one) on the host of ``--listen``,
serves the Starlette app with uvicorn (TLS with the gRPC server's certificate when it has one;
uvicorn's own signal handling is off: the gateway owns SIGINT/SIGTERM) and runs the
:class:`gateway.http_api.finalizer.Finalizer` every ``FINALIZE_EVERY_S`` seconds. On stop it
drains: requests in flight get ``GRACE_S`` to finish, and batch creations still running after
that are waited for (``DRAIN_S``) before the gateway goes on to close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from gateway.batches.service import BatchService
from gateway.config import GatewayConfig
from gateway.http_api.finalizer import Finalizer
from gateway.http_api.front import OpenAIFront
from gateway.http_api.stores import open_store

log = logging.getLogger(__name__)

FINALIZE_EVERY_S = 0.5
#: how long a stopping front lets requests in flight finish (uvicorn's graceful shutdown), and then
#: how long it waits for batch creations and cancels whose requests it had to cut (:meth:`OpenAIFront.drain`)
GRACE_S = 25.0
DRAIN_S = 30.0


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the gateway handles signals, not uvicorn
        yield


def _bind(host: str, port: int) -> socket.socket:
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP (an accepted one
    # inherits it); without it each response on a kept-alive connection waited ~40 ms (delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"HTTP front: cannot listen on {host}:{port}: {e}") from e
    sock.set_inheritable(True)
    return sock


class HttpServer:
    def __init__(self, service: BatchService, config: GatewayConfig):
        self.service, self.config = service, config
        self.queue = service.d.queue
        self._server: _Uvicorn | None = None
        self._front: OpenAIFront | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> str:
        """Listen and serve; returns the base URL of the API (``http://host:port/v1``)."""
        cfg = self.config
        if not cfg.http_api_key:
            raise ValueError("the HTTP front needs an API key: --http-api-key or $FLEETBATCH_HTTP_API_KEY")
        store = await asyncio.to_thread(open_store, cfg.files_dir or "runs/openai-files")  # a dir or s3://
        self._front = OpenAIFront(self.service, self.queue, cfg, store, self.service.d.tokenizer)
        app = self._front.app()
        host = cfg.listen.rsplit(":", 1)[0]
        sock = _bind(host, cfg.http_port or 0)
        tls = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key} if cfg.tls_cert else {}
        config = uvicorn.Config(
            app, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=GRACE_S, **tls
        )
        self._server = _Uvicorn(config)
        serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        self._tasks.append(serving)
        while not self._server.started:
            if serving.done():
                serving.result()
                raise OSError("the HTTP front stopped while starting")
            await asyncio.sleep(0.02)
        finalizer = Finalizer(self.queue, store, retention_s=cfg.retention_s, metrics=self.service.d.metrics)
        self._tasks.append(asyncio.create_task(self._finalize_loop(finalizer)))
        port = sock.getsockname()[1]
        shown = f"[{host.strip('[]')}]" if ":" in host.strip("[]") else host
        url = f"{'https' if cfg.tls_cert else 'http'}://{shown}:{port}/v1"
        log.info("OpenAI-compatible HTTP front on %s (files in %s)", url, store)
        return url

    async def _finalize_loop(self, finalizer: Finalizer) -> None:
        while True:
            try:
                await asyncio.to_thread(finalizer.tick)
            except Exception:
                log.exception("finalizing OpenAI batches failed; retrying")
            await asyncio.sleep(FINALIZE_EVERY_S)

    async def stop(self) -> None:
        """Stop listening, let the requests in flight finish (up to ``GRACE_S``), then wait for the
        batch creations and cancels of requests cut short (up to ``DRAIN_S``): a batch created
        while the front stops keeps its record."""
        if self._server is not None:
            self._server.should_exit = True
        serving, rest = self._tasks[:1], self._tasks[1:]
        for t in rest:
            t.cancel()
        for t in [*serving, *rest]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(t, timeout=GRACE_S + 5)
        if self._front is not None:
            await self._front.drain(DRAIN_S)
