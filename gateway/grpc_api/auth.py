"""Who is calling the batch API: per-client Bearer tokens, checked by a server interceptor.

Every ``fleetbatch.v1.BatchService`` call needs ``authorization: Bearer <token>`` in its
metadata; a missing or unknown token is ``UNAUTHENTICATED`` before the handler runs. Each token
names one client (``alice:<token>``): that name is the client of the per-client cap
(:mod:`gateway.batches.quota`), so a client cannot act as another by sending a header. The admin token
(``FLEETBATCH_ADMIN_TOKEN``) is also a client token, of the client ``admin``, which sees every
batch (no tokens-file entry may be named ``admin``). The admin API needs the admin token, checked
by :class:`AdminInterceptor` before a request is decoded; health checks and reflection need no token.
The HTTP front calls the batch service as a client of its own (:data:`HTTP_CLIENT`).

Tokens come from a file (``fleetbatch gateway serve --client-tokens FILE``) or ``$FLEETBATCH_CLIENT_TOKENS``,
one ``CLIENT:TOKEN`` per line or comma-separated, ``#`` starting a comment. Clients send their token
from ``$FLEETBATCH_TOKEN`` or a file (:func:`client_token`; ``fleetbatch gateway up`` writes one, 0600, and
names it in ``gateway.json`` as ``client_token_file``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import grpc

from gateway.batches.errors import ADMIN_CLIENT, HTTP_CLIENT
from gateway.checks.validation import id_problem

__all__ = ["ADMIN_CLIENT", "HTTP_CLIENT"]  # the identities, for the modules that know them from here

TOKENS_ENV = "FLEETBATCH_CLIENT_TOKENS"  # the server's CLIENT:TOKEN table
CLIENT_TOKEN_ENV = "FLEETBATCH_TOKEN"  # a client's own token
MIN_TOKEN_CHARS = 16
AUTH_HEADER = "authorization"


def parse_tokens(text: str, source: str) -> dict[str, str]:
    """``CLIENT:TOKEN`` entries (newline- or comma-separated) as a token -> client table; an error
    names the line. ``admin`` is the admin token's client (:data:`ADMIN_CLIENT`): no entry may take it."""
    table: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        for raw in line.split("#", 1)[0].split(","):
            entry, where = raw.strip(), f"{source} line {n}"
            if not entry:
                continue
            client, sep, token = entry.partition(":")
            client, token = client.strip(), token.strip()
            if not sep or not token:
                raise ValueError(f"{where}: expected CLIENT:TOKEN, got an entry without a token")
            problem = id_problem(client, "client id")
            if problem:
                raise ValueError(f"{where}: {problem}")
            if client == ADMIN_CLIENT:
                raise ValueError(
                    f"{where}: the client name {ADMIN_CLIENT!r} is the admin token's (it sees every "
                    "batch); give this client another name"
                )
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(
                    f"{where}: the token of {client!r} is shorter than {MIN_TOKEN_CHARS} characters"
                )
            if token in table:
                raise ValueError(f"{where}: clients {table[token]!r} and {client!r} have the same token")
            table[token] = client
    return table


def load_tokens(path: str | None) -> dict[str, str]:
    """The token table of ``path`` (when given), else of ``$FLEETBATCH_CLIENT_TOKENS`` (may be empty)."""
    if path:
        try:
            return parse_tokens(Path(path).read_text(encoding="utf-8"), path)
        except OSError as e:
            raise FileNotFoundError(f"cannot read the client tokens file {path}: {e.strerror}") from None
    return parse_tokens(os.environ.get(TOKENS_ENV, ""), f"${TOKENS_ENV}")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    """Maps a call's Bearer token to its client. Looked up by the token's SHA-256, so the lookup
    takes the same time whatever prefix of a real token a caller guesses."""

    def __init__(self, tokens: Mapping[str, str], admin_token: str = "") -> None:
        self._clients = {_digest(t): c for t, c in tokens.items()}
        if admin_token:
            self._clients.setdefault(_digest(admin_token), ADMIN_CLIENT)

    @property
    def enabled(self) -> bool:
        return bool(self._clients)

    def client(self, metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
        """The client whose token the metadata carries, or None."""
        value = dict(metadata).get(AUTH_HEADER)
        if not isinstance(value, str) or not value.startswith("Bearer "):
            return None
        return self._clients.get(_digest(value[len("Bearer ") :].strip()))


def admin_refusal(
    metadata: Sequence[tuple[str, str | bytes]], token: str
) -> tuple[grpc.StatusCode, str] | None:
    """Why a call with ``metadata`` may not use the admin API whose token is ``token``, or None."""
    if not token:
        return grpc.StatusCode.PERMISSION_DENIED, "the admin API is disabled: no admin token configured"
    given = dict(metadata).get(AUTH_HEADER, "")
    given = given.encode() if isinstance(given, str) else given
    if not hmac.compare_digest(given, f"Bearer {token}".encode()):
        return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong admin token"
    return None


def _refused(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that answers ``code``; no deserializer: the refused request is never decoded."""

    async def abort(request, context):
        await context.abort(code, message)

    async def abort_stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - an async generator, never reached

    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(abort_stream, None, handler.response_serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(abort, None, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(abort, None, handler.response_serializer)


class _GuardInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls of one service (full name) before their request is decoded: :meth:`refusal`
    says why (a status code and a message), or ``None`` to let the call through."""

    def __init__(self, service: str) -> None:
        self.prefix = f"/{service}/"

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]]) -> tuple[grpc.StatusCode, str] | None:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        refusal = self.refusal(details.invocation_metadata or ())
        return handler if refusal is None else _refused(handler, *refusal)


class AuthInterceptor(_GuardInterceptor):
    """``UNAUTHENTICATED`` for calls of ``service`` (full name) without a known Bearer token."""

    def __init__(self, auth: Authenticator, service: str) -> None:
        super().__init__(service)
        self.auth = auth

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]]) -> tuple[grpc.StatusCode, str] | None:
        if self.auth.client(metadata) is not None:
            return None
        given = any(k == AUTH_HEADER for k, _ in metadata)
        message = (
            "wrong client token" if given else "missing client token: send 'authorization: Bearer <token>'"
        )
        return grpc.StatusCode.UNAUTHENTICATED, message


class AdminInterceptor(_GuardInterceptor):
    """The admin token on every call of ``service`` (the admin API), checked before its request is
    decoded or counted against the in-flight bytes (:func:`admin_refusal`)."""

    def __init__(self, token: Callable[[], str], service: str) -> None:
        super().__init__(service)
        self.token = token

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]]) -> tuple[grpc.StatusCode, str] | None:
        return admin_refusal(metadata, self.token())


def client_token(token: str | None = None, token_file: str | os.PathLike | None = None) -> str:
    """A client's token: ``token``, else ``$FLEETBATCH_TOKEN``, else the first line of ``token_file``
    (when it exists), else "" (no token sent)."""
    if token:
        return token
    if os.environ.get(CLIENT_TOKEN_ENV):
        return os.environ[CLIENT_TOKEN_ENV]
    if token_file and Path(token_file).exists():
        return Path(token_file).read_text(encoding="utf-8").strip()
    return ""


def deployment_token(info: Mapping[str, object]) -> str:
    """The client token of a ``fleetbatch gateway up`` deployment, from its ``gateway.json`` (``info``)."""
    path = info.get("client_token_file")
    return Path(str(path)).read_text(encoding="utf-8").strip() if path else ""
