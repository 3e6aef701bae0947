"""What the routes of the OpenAI-compatible HTTP front (:mod:`gateway.http_front`) share: OpenAI's
error body, gRPC status codes as HTTP statuses, the context of an in-process ``BatchService``
call, and the ``Authorization: Bearer <key>`` check (ASGI middleware)."""

from __future__ import annotations

import hmac
import json

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.auth import InProcessCall
from gateway.quota import CLIENT_HEADER

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
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


class CallContext(InProcessCall):
    """What :class:`BatchService` asks of a gRPC context, for an in-process call: the caller is the
    HTTP front (its batches are its own), the client of the per-client cap its ``x-client-id`` header
    or its address."""

    def __init__(self, request: Request):
        client = request.client
        self._peer = f"ipv4:{client.host}:{client.port}" if client else "unknown"
        header = request.headers.get(CLIENT_HEADER)
        self._metadata = [(CLIENT_HEADER, header)] if header is not None else []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise ApiError(HTTP_STATUS.get(code, 500), details, code=code.name.lower())


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
