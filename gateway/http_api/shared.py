"""What the routes of the OpenAI-compatible HTTP front (:mod:`gateway.http_api.front`) share: OpenAI's
error body, the batch service's refusals as HTTP statuses, who calls (:func:`caller_of`), and the
``Authorization: Bearer <key>`` check (ASGI middleware)."""

from __future__ import annotations

import hmac
import json

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.batches import quota
from gateway.batches.errors import (
    HTTP_CLIENT,
    BatchError,
    Caller,
    Conflict,
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    Unavailable,
)

#: the batch service's refusals as HTTP statuses, with OpenAI's error code
HTTP_STATUS: dict[type[BatchError], tuple[int, str]] = {
    InvalidRequest: (400, "invalid_argument"),
    NotFound: (404, "not_found"),
    Conflict: (409, "already_exists"),
    QuotaExceeded: (429, "resource_exhausted"),
    Unavailable: (503, "unavailable"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def api_error(e: BatchError) -> ApiError:
    """The batch service's refusal as the HTTP front answers it."""
    status, code = HTTP_STATUS[type(e)]
    return ApiError(status, str(e), code=code)


def caller_of(request: Request) -> Caller:
    """Who calls over HTTP: the front's own identity (the API key is one for all, and the front owns
    the batches made over HTTP); the per-client cap counts its ``x-client-id`` header, else its address."""
    header = request.headers.get(quota.CLIENT_HEADER)
    headers = {quota.CLIENT_HEADER: header} if header is not None else {}
    client = request.client
    return quota.unproven_caller(
        HTTP_CLIENT, headers, f"ipv4:{client.host}:{client.port}" if client else "unknown"
    )


async def json_body(request: Request, limit: int):
    """The request's JSON body, read up to ``limit`` bytes (413 past it: never held whole in
    memory); 400 when it is not JSON (nesting too deep included)."""
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise ApiError(413, f"the request body has more than {limit} bytes, the limit")
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body must be a JSON object") from None


def utf8_problem(metadata: dict[str, str]) -> str | None:
    """JSON allows lone surrogates (``\\ud800``), which UTF-8, and so protobuf, cannot carry."""
    try:
        for k, v in metadata.items():
            k.encode(), v.encode()
    except UnicodeEncodeError:
        return "metadata holds a lone surrogate (\\ud800-\\udfff), which is not text"
    return None


class Auth:
    """ASGI middleware: ``Authorization: Bearer <key>`` on every request, else 401 in OpenAI's shape; the
    ``public`` paths (a page that holds no data) are served without it."""

    def __init__(self, app, key: str, public: tuple[str, ...] = ()):
        self.app, self.key, self.public = app, key.encode(), frozenset(public)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path") not in self.public:
            headers = dict(scope.get("headers") or [])
            got = headers.get(b"authorization", b"")
            if not (got.startswith(b"Bearer ") and hmac.compare_digest(got[7:].strip(), self.key)):
                message = "Incorrect or missing API key: send 'Authorization: Bearer <key>'"
                response = error_response(401, message, code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
