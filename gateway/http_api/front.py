"""The gateway's OpenAI-compatible HTTP front: ``/v1/files`` and ``/v1/batches`` (Starlette on uvicorn).

It runs in the gateway's process and event loop, beside the gRPC server, and goes through the
same batch service: a batch is created from its input file, read twice as a stream (checked line
by line, then sent: as one ``SubmitBatchRequest`` when small, else message by message as
``SubmitBatchStream`` sends it, never held whole) through :class:`gateway.batches.service.BatchService`,
so validation, size limits, the per-client cap, assignment and background intake are the gRPC API's; the service's refusals become HTTP
statuses (:data:`gateway.http_api.shared.HTTP_STATUS`: 400, 404, 409, 429, 503) with OpenAI's error
body (``{"error": {"message", "type", "param", "code"}}``). Every request needs
``Authorization: Bearer <key>`` (401 otherwise). The front is a client of its own
(:data:`gateway.batches.errors.HTTP_CLIENT`): it owns the batches made over HTTP and answers 404 for every
other id, a gRPC client's batch included. The client of the per-client cap is ``hdr:`` and the
``x-client-id`` header, else ``ip:`` and the peer's address, as over gRPC without tokens. An invalid input file is no
4xx: the batch is created and ``failed`` at once with ``errors`` naming its lines, as OpenAI
does (:meth:`OpenAIFront.create`). Creations and cancels run to their end even when their
request is cut, and the front waits for them when it stops (:meth:`OpenAIFront.drain`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Iterator
from functools import partial
from typing import Any, TypeVar

from redis.exceptions import ResponseError
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.batches.errors import (
    HTTP_CLIENT,
    REDIS_DOWN,
    BatchError,
    Caller,
    NotFound,
    redis_down,
)
from gateway.batches.service import BatchService
from gateway.checks.validation import Limits, id_problem
from gateway.config import GatewayConfig
from gateway.http_api import batches as ob
from gateway.http_api.create import CreateBatch, check_create, submit_file
from gateway.http_api.files import (
    CHUNK,
    FileStore,
    StoreUnavailable,
    TooLarge,
    list_files,
    new_file_id,
    read_lines,
)
from gateway.http_api.format import ChatTemplate
from gateway.http_api.health import HEALTH_PATH, health_route
from gateway.http_api.retention import InUse, delete_file, deleting, retire
from gateway.http_api.shared import ApiError, Auth, api_error, caller_of, error_response, json_body
from gateway.http_api.status_page import PAGE_PATH, StatusPage
from workqueue import BatchState, WorkQueue

log = logging.getLogger(__name__)
T = TypeVar("T")

BODY_LIMIT = 1 << 20  # bytes of a JSON request body (metadata has at most 16 KiB)


class OpenAIFront:
    """The routes' state: the gateway's batch service, its queue and config, the file store, the key."""

    def __init__(
        self, service: BatchService, queue: WorkQueue, config: GatewayConfig, store: FileStore, tokenizer
    ):
        self.service, self.queue, self.config, self.store = service, queue, config, store
        self.template = ChatTemplate.of(tokenizer, config.chat_template, config.tokenizer_dir)
        self.key = config.http_api_key
        self.limits = Limits.of(config)
        self._inflight: set[asyncio.Task] = set()  # creations and cancels (:meth:`durable`)
        self.status_page = StatusPage(queue, service.d.eta)  # GET /status and /v1/fleet/status

    def app(self) -> Starlette:
        routes = [
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files", self.files, methods=["GET"]),
            Route("/v1/files/{file_id}", self.file, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.content, methods=["GET"]),
            Route("/v1/batches", self.create, methods=["POST"]),
            Route("/v1/batches", self.listing, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.get, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"]),
            *self.status_page.routes(),
            health_route(self.queue),  # GET /healthz: Kubernetes' readiness probe
        ]
        handlers = {ApiError: self._api_error, HTTPException: self._http_error, Exception: self._crash}
        handlers.update(dict.fromkeys((*REDIS_DOWN, ResponseError), self._redis_down))
        handlers[StoreUnavailable] = self._store_down
        app = Starlette(routes=routes, exception_handlers=handlers)
        app.add_middleware(Auth, key=self.key, public=(PAGE_PATH, HEALTH_PATH))
        return app

    async def _api_error(self, request: Request, e: Exception) -> Response:
        assert isinstance(e, ApiError)
        return error_response(e.status, e.message, e.param, e.code)

    async def _http_error(self, request: Request, e: Exception) -> Response:
        assert isinstance(e, HTTPException)
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}")

    async def _redis_down(self, request: Request, e: Exception) -> Response:
        if not redis_down(e):  # a Redis error that will not pass by retrying
            return await self._crash(request, e)
        log.warning("HTTP call failed on Redis: %s", e)
        return error_response(503, f"the queue store (Redis) is unavailable, retry later: {e}")

    async def _store_down(self, request: Request, e: Exception) -> Response:
        log.warning("HTTP %s %s failed on the file store: %s", request.method, request.url.path, e)
        return error_response(503, f"{e}; retry later")

    async def _crash(self, request: Request, e: Exception) -> Response:
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}")

    # ------------------------------------------------------------------ files

    async def upload(self, request: Request) -> Response:
        limit = self.config.max_request_bytes
        length = request.headers.get("content-length")
        if length is None:  # chunked: request.form() would spool it whole before any check
            raise ApiError(411, "an upload needs a Content-Length header (no chunked uploads)", "file")
        if length.isdigit() and int(length) > limit + CHUNK:
            raise ApiError(413, f"the upload has {length} bytes; the limit is {limit}", "file")
        form = await request.form(max_files=1, max_fields=8)
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise ApiError(400, f"purpose must be 'batch', not {purpose!r}", "purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "a multipart 'file' field is required", "file")
            name = upload.filename or "input.jsonl"

            def chunks() -> Iterator[bytes]:
                while chunk := upload.file.read(CHUNK):
                    yield chunk

            try:
                info = await asyncio.to_thread(self.store.put, new_file_id(), name, "batch", chunks(), limit)
            except TooLarge as e:
                raise ApiError(413, str(e), "file") from None
        finally:
            await form.close()
        return JSONResponse(info.as_json())

    def _info(self, file_id: str):
        info = self.store.info(file_id)
        if info is None:
            raise ApiError(404, f"no file {file_id!r}", "file_id")
        return info

    async def file(self, request: Request) -> Response:
        info = await asyncio.to_thread(self._info, request.path_params["file_id"])
        return JSONResponse(info.as_json())

    async def files(self, request: Request) -> Response:
        """OpenAI's list of files: ``purpose``, ``limit`` (1..10000, default 10000), ``order``, ``after``."""
        q = request.query_params
        limit = _whole(q.get("limit", "10000"), "limit", 10_000)
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be 'asc' or 'desc', not {order!r}", "order")
        try:
            page, more = await asyncio.to_thread(
                list_files, self.store, limit, q.get("after"), q.get("purpose"), order
            )
        except ValueError as e:
            raise ApiError(400, str(e), "after") from None
        return JSONResponse(_page([f.as_json() for f in page], more))

    async def delete(self, request: Request) -> Response:
        """OpenAI's deletion object; 404 unknown; 409 for the input of a batch not finalized yet."""
        file_id = request.path_params["file_id"]
        try:
            found = await asyncio.to_thread(delete_file, self.queue, self.store, file_id)
        except InUse as e:
            raise ApiError(409, str(e), "file_id", "file_in_use") from None
        if not found:
            raise ApiError(404, f"no file {file_id!r}", "file_id")
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    async def content(self, request: Request) -> Response:
        file_id = request.path_params["file_id"]
        await asyncio.to_thread(self._info, file_id)
        return StreamingResponse(self.store.chunks(file_id), media_type="application/jsonl")

    # ---------------------------------------------------------------- batches

    async def create(self, request: Request) -> Response:
        """A malformed request is a 4xx and creates nothing; otherwise the batch is created (its
        record written before the answer) and, when its input file is invalid, ``failed`` at once
        with ``errors`` naming the lines, nothing enqueued (OpenAI's behaviour)."""
        body = await json_body(request, BODY_LIMIT)
        c = check_create(body, self.limits)
        caller = caller_of(request)
        if caller.client_problem:
            raise ApiError(400, caller.client_problem)
        info = await asyncio.to_thread(self._info, c.file_id)
        if info.purpose != "batch":
            raise ApiError(
                400, f"file {c.file_id} has purpose {info.purpose!r}, not 'batch'", "input_file_id"
            )
        held = min(info.bytes, ob.HELD_BYTES)  # a larger file is streamed
        work = self._counted(held, self._create(ob.new_batch_id(), c, caller))
        return JSONResponse(await self.durable(work))

    async def _counted(self, size: int, work: Coroutine[Any, Any, T]) -> T:
        """``work`` (a creation) with the bytes of its input file it holds (``size``) counted in the gateway's in-flight
        bytes (``--max-inflight-mb``), as a gRPC request's are: 429 (retry later) before anything is
        written, when it does not fit."""
        budget = self.service.d.inflight
        if budget is not None and not budget.acquire(size):
            work.close()
            raise ApiError(429, budget.refusal(size), code="resource_exhausted")
        try:
            return await work
        finally:
            if budget is not None:
                budget.release(size)

    async def _create(self, batch_id: str, c: CreateBatch, caller: Caller) -> dict:
        file_id = c.file_id
        await asyncio.to_thread(ob.create_record, self.queue, batch_id, file_id, c.endpoint, c.window)
        if await asyncio.to_thread(deleting, self.queue, self.store, file_id):
            await asyncio.to_thread(ob.drop_record, self.queue, batch_id)
            raise ApiError(404, f"file {file_id} was deleted", "input_file_id")
        lines = partial(read_lines, self.store, file_id)  # read twice: checked, then sent
        try:
            errors = await submit_file(self.service, lines, self.template, self.limits, c, batch_id, caller)
            if errors:  # nothing was submitted
                return await asyncio.to_thread(self._fail, batch_id, file_id, errors)
        except BatchError as e:  # 409, 429, 503: retry later
            if not await self._forget_unless_created(batch_id):
                raise api_error(e) from None
            log.exception("batch %s: created, then the submission failed; keeping it", batch_id)
        except Exception:
            if not await self._forget_unless_created(batch_id):
                raise
            log.exception("batch %s: created, then the submission failed; keeping it", batch_id)
        except BaseException:  # cancelled (the drain gave up): keep a batch that exists
            await self._forget_unless_created(batch_id)
            raise
        await self._cancel_if_asked(batch_id, caller)  # a cancel that came while the file was read
        return await asyncio.to_thread(self._object, batch_id)

    def _fail(self, batch_id: str, file_id: str, errors: list[ob.LineError]) -> dict:
        """The batch of an invalid input file: ``failed``, retained as a finalized batch."""
        pipe = self.queue.r.pipeline(transaction=True)
        ob.fail_invalid(pipe, batch_id, errors)
        retire(self.queue, batch_id, [file_id], self.config.retention_s, pipe)
        pipe.execute()
        log.info("batch %s: its input file %s is invalid (%d errors): failed", batch_id, file_id, len(errors))
        return self._object(batch_id)

    async def durable(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` (a creation, a cancel: Redis writes that must not stop halfway) to its end
        even when the request is cancelled, as uvicorn does to requests still running when its
        graceful shutdown times out; :meth:`drain` waits for it."""
        task = asyncio.ensure_future(work)
        self._inflight.add(task)
        task.add_done_callback(self._settled)
        return await asyncio.shield(task)

    def _settled(self, task: asyncio.Task) -> None:
        self._inflight.discard(task)
        error = None if task.cancelled() else task.exception()  # retrieved: its request may be gone
        if error is not None and not isinstance(error, ApiError):
            log.warning("a batch creation or cancel failed: %r", error)

    async def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the creations and cancels in flight; how many were left."""
        if self._inflight:
            log.info("HTTP front: waiting for %d batch creations or cancels", len(self._inflight))
            await asyncio.wait(set(self._inflight), timeout=timeout)
        for task in self._inflight:
            log.error("HTTP front: a batch creation or cancel did not end within %.0f s", timeout)
            task.cancel()
        return len(self._inflight)

    async def _forget_unless_created(self, batch_id: str) -> bool:
        """After a failed ``SubmitBatch``: drop the batch's record unless the gateway batch exists
        (it runs: the finalizer needs the record); whether it exists. Shielded from cancellation."""

        def settle() -> bool:
            if self.queue.batch(batch_id) is not None:
                return True
            ob.drop_record(self.queue, batch_id)
            return False

        try:
            return await asyncio.shield(asyncio.to_thread(settle))
        except Exception:  # Redis down: the finalizer drops an orphan record after ORPHAN_S
            log.exception("batch %s: cannot settle its record after a failed submission", batch_id)
            return False

    def _object(self, batch_id: str) -> dict:
        if id_problem(batch_id, "batch id"):
            raise ApiError(404, f"no batch {batch_id!r}", "batch_id")
        batch = ob.batch_objects(self.queue, [batch_id], HTTP_CLIENT, self.service.d.eta.all())[batch_id]
        if batch is None:  # no record, or a gRPC client's batch
            raise ApiError(404, f"no batch {batch_id!r}", "batch_id")
        return batch

    async def get(self, request: Request) -> Response:
        return JSONResponse(await asyncio.to_thread(self._object, request.path_params["batch_id"]))

    def _over(self, batch_id: str) -> dict | None:
        """For a cancel: None while the batch runs; the object unchanged when it was cancelled
        already; 409 (OpenAI's answer for cancelling a completed batch) when it is over otherwise
        (completed, failed, finalizing, expired); 404 for unknown ids."""
        batch = self._object(batch_id)
        info = self.queue.batch(batch_id)
        if info is None:
            if batch["status"] == "validating":
                return None  # being created: CancelBatch answers
        elif not info.final:
            return None
        elif info.status == BatchState.CANCELLED:
            return batch
        raise ApiError(409, f"Cannot cancel a batch with status '{batch['status']}'.", "batch_id")

    async def cancel(self, request: Request) -> Response:
        """Cancel a running batch (``cancelling_at`` set once); see :meth:`_over` for the others."""
        batch_id = request.path_params["batch_id"]
        unchanged = await asyncio.to_thread(self._over, batch_id)
        if unchanged is not None:
            return JSONResponse(unchanged)
        return JSONResponse(await self.durable(self._cancel(batch_id, caller_of(request))))

    async def _cancel(self, batch_id: str, caller: Caller) -> dict:
        try:
            done = (await self.service.cancel(batch_id, caller)).info
        except NotFound:  # its creation is still reading the file: recorded, applied once the batch exists
            await asyncio.to_thread(ob.set_record_once, self.queue.r, batch_id, "cancelling_at", time.time())
            await self._cancel_if_asked(batch_id, caller)  # it may have been created meanwhile
            return await asyncio.to_thread(self._object, batch_id)
        except BatchError as e:
            raise api_error(e) from None
        if done.status in (BatchState.COMPLETED, BatchState.FAILED):  # it finished meanwhile
            await asyncio.to_thread(self._over, batch_id)
        await asyncio.to_thread(ob.set_record_once, self.queue.r, batch_id, "cancelling_at", time.time())
        return await asyncio.to_thread(self._object, batch_id)

    async def _cancel_if_asked(self, batch_id: str, caller: Caller) -> None:
        """Cancel the gateway batch if it exists and a cancel came while it was being created."""
        rec = await asyncio.to_thread(self.queue.r.hget, ob.record_key(batch_id), "cancelling_at")
        if rec and await asyncio.to_thread(self.queue.batch, batch_id) is not None:
            await self.service.cancel(batch_id, caller)

    async def listing(self, request: Request) -> Response:
        """Batches created over HTTP only (``{fb}:oai:batches``), newest first."""
        limit = _whole(request.query_params.get("limit", "20"), "limit", 100)
        try:
            ids, more = await asyncio.to_thread(
                ob.list_batches, self.queue, limit, request.query_params.get("after")
            )
        except ob.BadInput as e:
            raise ApiError(400, str(e), e.param) from None
        etas = self.service.d.eta.all()
        batches = await asyncio.to_thread(
            ob.batch_objects, self.queue, ids, HTTP_CLIENT, etas
        )  # one round trip
        return JSONResponse(_page([b for b in batches.values() if b is not None], more))


def _whole(raw: str, name: str, most: int) -> int:
    """A query parameter that must be a whole number in ``[1, most]`` (400 otherwise). ASCII digits
    only, and few: ``str.isdigit`` is also true of ``²``, which ``int`` refuses, and ``int`` refuses
    more than 4,300 digits (both were 500s, found by the fuzz test)."""
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9) or not 1 <= int(raw) <= most:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise ApiError(400, f"{name} must be a whole number in [1, {most}], not {shown!r}", name)
    return int(raw)


def _page(data: list[dict], more: bool) -> dict:
    """OpenAI's list object."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }
