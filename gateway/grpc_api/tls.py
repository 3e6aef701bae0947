"""TLS for the gateway's gRPC port and its clients.

The server serves TLS when given a certificate chain and its key (``--tls-cert``,
``--tls-key``, PEM files); clients (``fleetbatch gateway rebalance``/``status``, ``fleetbatch loadgen submit``)
connect with TLS when given the CA that signed it (``--tls-ca``), and send their client token
(:mod:`gateway.grpc_api.auth`) as ``authorization: Bearer <token>`` on every call. Redis over TLS needs no
code here: a ``rediss://`` URL (``rediss://host:port?ssl_ca_certs=/path/ca.pem``) is enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

from gateway.grpc_api.auth import AUTH_HEADER, client_token


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise FileNotFoundError(f"cannot read the TLS {what} {path}: {e.strerror}") from None


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    """Credentials of a TLS port from PEM files: the certificate chain and its private key."""
    if not cert or not key:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return grpc.ssl_server_credentials([(_read(key, "key"), _read(cert, "certificate"))])


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call of a channel (plaintext or TLS)."""

    def __init__(self, token: str) -> None:
        self.header = (AUTH_HEADER, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != AUTH_HEADER]
        return details._replace(metadata=[*metadata, self.header])  # type: ignore[attr-defined]

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def channel(
    target: str, tls_ca: str | None = None, options: Sequence[tuple] = (), token: str | None = None
) -> grpc.Channel:
    """A channel to the gateway: TLS verified against ``tls_ca`` when given, else plaintext; every
    call carries ``token`` (None: ``$FLEETBATCH_TOKEN``; "": no token)."""
    if tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca, "CA"))
        ch = grpc.secure_channel(target, creds, options=list(options))
    else:
        ch = grpc.insecure_channel(target, options=list(options))
    token = client_token() if token is None else token
    return grpc.intercept_channel(ch, _BearerToken(token)) if token else ch
