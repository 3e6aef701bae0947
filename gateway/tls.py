"""TLS for the gateway's gRPC port and its clients.

The server serves TLS when given a certificate chain and its key (``--tls-cert``,
``--tls-key``, PEM files); clients (``gateway rebalance``/``status``, ``loadgen submit``)
connect with TLS when given the CA that signed it (``--tls-ca``). Redis over TLS needs no
code here: a ``rediss://`` URL (``rediss://host:port?ssl_ca_certs=/path/ca.pem``) is enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc


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


def channel(target: str, tls_ca: str | None = None, options: Sequence[tuple] = ()) -> grpc.Channel:
    """A channel to the gateway: TLS verified against ``tls_ca`` when given, else plaintext."""
    if tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca, "CA"))
        return grpc.secure_channel(target, creds, options=list(options))
    return grpc.insecure_channel(target, options=list(options))
