"""TLS to Redis (``rediss://``): the client's certificates from the environment, and plain words for what fails.

An engine in another cloud reaches the home Redis across the internet over TLS, as an ACL user of
its own (:mod:`workqueue.acl`): ``rediss://USER:PASSWORD@HOST:PORT/DB``. For such a URL every client
:func:`workqueue.embedded.connect` makes checks the server's certificate against
``$FLEETBATCH_REDIS_CA`` (a PEM file of the CA that signed it; unset: the system's CAs, as for a
managed Redis with a public certificate) and checks that it names ``HOST``; with
``$FLEETBATCH_REDIS_CERT`` and ``$FLEETBATCH_REDIS_KEY`` (both or neither) it also shows a client
certificate, for a server started with ``--tls-auth-clients yes``. ``ssl_*`` options in the URL's
query (``?ssl_ca_certs=...``) win over the environment.

A failure reads as what went wrong and what to check (:func:`explain`), never as a traceback.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

CA_ENV = "FLEETBATCH_REDIS_CA"
CERT_ENV = "FLEETBATCH_REDIS_CERT"
KEY_ENV = "FLEETBATCH_REDIS_KEY"
TLS_SCHEMES = ("rediss", "rediss+cluster")


def uses_tls(url: str) -> bool:
    return url.partition("://")[0] in TLS_SCHEMES


def _pem(env: str) -> str | None:
    """The file ``$env`` names; ``FileNotFoundError`` naming both when it is not there."""
    path = os.environ.get(env)
    if not path:
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"${env} names {path}, which is not a file")
    return path


def tls_options(url: str) -> dict:
    """The redis-py ``ssl_*`` keyword arguments for ``url`` ({} unless it is ``rediss://``)."""
    if not uses_tls(url):
        return {}
    cert, key = _pem(CERT_ENV), _pem(KEY_ENV)
    if (cert is None) != (key is None):
        raise ValueError(f"${CERT_ENV} and ${KEY_ENV} go together: set both (mutual TLS) or neither")
    options: dict = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    ca = _pem(CA_ENV)
    if ca is not None:
        options["ssl_ca_certs"] = ca
    if cert is not None:
        options.update(ssl_certfile=cert, ssl_keyfile=key)
    return options


#: (text in the library's or OpenSSL's message, what it means) - the first that matches is said
_CAUSES = (
    (
        "certificate has expired",
        "the server's TLS certificate has expired (or is not valid yet: check the clocks)",
    ),
    ("not yet valid", "the server's TLS certificate is not valid yet (check the clocks)"),
    (
        "mismatch",
        "the server's TLS certificate does not name {host} (hostname check): connect by a name its "
        "certificate lists, or issue one that lists {host}",
    ),
    (
        "CERTIFICATE_VERIFY_FAILED",
        "TLS certificate verify failed (is ${ca} the CA that signed the server's certificate?)",
    ),
    (
        "certificate required",
        "the server asks for a client certificate: set ${cert} and ${key}",
    ),
    ("unknown ca", "the server does not trust the client certificate in ${cert}"),
    ("bad certificate", "the server refused the client certificate in ${cert}"),
    ("WRONG_VERSION_NUMBER", "the server does not speak TLS on this port (redis:// instead of rediss://?)"),
    ("wrong version number", "the server does not speak TLS on this port (redis:// instead of rediss://?)"),
    ("record layer failure", "the server does not speak TLS on this port (redis:// instead of rediss://?)"),
    ("PEM lib", "cannot read the certificate or key files (${ca}, ${cert}, ${key}: PEM expected)"),
    ("invalid username-password", "wrong user name or password (WRONGPASS), or the ACL user is disabled"),
    ("invalid password", "wrong password"),
    ("Authentication required", "the server needs a password: put USER:PASSWORD@ in the URL"),
    (
        "NOPERM",
        "the ACL user may not run the connection's first commands (`fleetbatch gateway redis-acl` prints its rules)",
    ),
)


#: the server ended the handshake without saying why to this side: under TLS 1.3 a refused client certificate
#: (or a missing one the server requires) reads so when the client writes before the server's alert arrives
_CUT = ("EOF occurred in violation of protocol", "UNEXPECTED_EOF")


def explain(error: BaseException, url: str) -> str:
    """``error`` (from connecting to ``url``) as one line: the cause in plain words, then the library's text."""
    text = str(error)
    host = urlsplit(url).hostname or "the host"
    names = {"host": host, "ca": CA_ENV, "cert": CERT_ENV, "key": KEY_ENV}
    for needle, meaning in _CAUSES:
        if needle.lower() in text.lower():
            return f"{meaning.format(**names)} [{text}]"
    if uses_tls(url) and any(cut.lower() in text.lower() for cut in _CUT):
        why = (
            f"does it trust the client certificate in ${CERT_ENV}?"
            if os.environ.get(CERT_ENV)
            else f"does it ask for a client certificate? set ${CERT_ENV} and ${KEY_ENV}"
        )
        return f"the server ended the TLS handshake ({why}) [{text}]"
    return text
