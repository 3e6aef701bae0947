"""A TCP proxy the harness controls: one-way delay and jitter, a bandwidth cap, and a cut switch.

``loadgen chaos`` puts one between an engine and Redis to partition them; it is also meant to
emulate a WAN link (issue 33). Each direction of a connection has its own :class:`Link`:

* ``delay_s`` and ``jitter_s``: every chunk read is held ``delay_s + U(0, jitter_s)`` seconds
  before it is forwarded, never overtaking the chunk before it (a TCP stream stays in order);
* ``bandwidth_bps``: bytes per second forwarded in that direction, per connection (0: no cap).

:meth:`TcpProxy.set_links` changes them at run time, live connections included.

:meth:`TcpProxy.cut` drops every live connection (both ends see it closed) and refuses new ones
(the listening socket is closed: ``ECONNREFUSED``); :meth:`TcpProxy.heal` listens again on the
same port. The upstream is ``(host, port)`` or a unix socket path. Threads: one acceptor, and per
connection one reader and one writer per direction; all stop on :meth:`close`.
"""

from __future__ import annotations

import logging
import queue
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
Address = tuple[str, int] | str  # (host, port) or a unix socket path


@dataclass
class Link:
    """One direction's impairments (all 0: a plain forward)."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth_bps: float = 0.0

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s", "bandwidth_bps"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")

    def hold_s(self, rng: random.Random) -> float:
        """How long one chunk is held before it is forwarded."""
        return self.delay_s + (rng.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0)


def _connect(upstream: Address, timeout_s: float) -> socket.socket:
    if isinstance(upstream, str):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(upstream)
    except OSError:
        s.close()
        raise
    s.settimeout(None)
    return s


class _Pipe:
    """One direction of one connection: a reader stamps chunks, a writer forwards them when due."""

    def __init__(
        self, src: socket.socket, dst: socket.socket, link: Callable[[], Link], rng: random.Random, done
    ):
        self.src, self.dst, self.link, self.rng, self.done = src, dst, link, rng, done
        self.chunks: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
        self.threads = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._write, daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        last_due = 0.0
        try:
            while data := self.src.recv(CHUNK):
                last_due = max(last_due, time.monotonic() + self.link().hold_s(self.rng))
                self.chunks.put((last_due, data))
        except OSError:
            pass
        self.chunks.put(None)

    def _write(self) -> None:
        try:
            while (item := self.chunks.get()) is not None:
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                bandwidth = self.link().bandwidth_bps
                if bandwidth:
                    for i in range(0, len(data), 4096):  # paced in small slices
                        piece = data[i : i + 4096]
                        self.dst.sendall(piece)
                        time.sleep(len(piece) / bandwidth)
                else:
                    self.dst.sendall(data)
            self.dst.shutdown(socket.SHUT_WR)  # the source closed: pass the EOF on
        except OSError:
            pass
        self.done()


class _Connection:
    def __init__(self, client: socket.socket, upstream: socket.socket, proxy: TcpProxy):
        self.sockets = (client, upstream)
        self._ends = 0
        self._lock = threading.Lock()
        self.proxy = proxy
        self.pipes = (
            _Pipe(client, upstream, lambda: proxy.up, proxy.rng, self._one_done),
            _Pipe(upstream, client, lambda: proxy.down, proxy.rng, self._one_done),
        )

    def start(self) -> None:
        for p in self.pipes:
            p.start()

    def _one_done(self) -> None:
        with self._lock:
            self._ends += 1
            last = self._ends == 2
        if last:
            self.drop()

    def drop(self) -> None:
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.proxy._forget(self)


class TcpProxy:
    """``TcpProxy(upstream).start()``; connect to :attr:`address`; :meth:`cut` / :meth:`heal`."""

    def __init__(
        self,
        upstream: Address,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        up: Link | None = None,
        down: Link | None = None,
        seed: int = 0,
        connect_timeout_s: float = 5.0,
    ):
        self.upstream = upstream
        self.host, self.port = host, port
        self.up = up or Link()  # client -> upstream
        self.down = down or Link()  # upstream -> client
        self.rng = random.Random(seed)
        self.connect_timeout_s = connect_timeout_s
        self.accepted = 0  # connections accepted so far
        self.refused_upstream = 0  # accepted, but the upstream could not be reached
        self._live: set[_Connection] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_cut(self) -> bool:
        return self._listener is None

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._live)

    def start(self) -> TcpProxy:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.port))
        s.listen(128)
        self.port = s.getsockname()[1]
        self._listener = s
        self._acceptor = threading.Thread(target=self._accept, args=(s,), name="tcp-proxy", daemon=True)
        self._acceptor.start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by cut() or close()
                return
            self.accepted += 1
            try:
                upstream = _connect(self.upstream, self.connect_timeout_s)
            except OSError as e:
                self.refused_upstream += 1
                log.debug("proxy %s: upstream %s unreachable: %s", self.address, self.upstream, e)
                client.close()
                continue
            conn = _Connection(client, upstream, self)
            with self._lock:
                if self._listener is not listener:  # cut while it connected
                    conn.sockets[0].close()
                    conn.sockets[1].close()
                    continue
                self._live.add(conn)
            conn.start()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._live.discard(conn)

    def _stop_listening(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            live = list(self._live)
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor
            except OSError:
                pass
            listener.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        for conn in live:
            conn.drop()

    def set_links(self, up: Link | None = None, down: Link | None = None) -> None:
        """Change a direction's impairments; live connections follow from their next chunk."""
        if up is not None:
            self.up = up
        if down is not None:
            self.down = down

    def cut(self) -> int:
        """Drop every live connection and refuse new ones; returns how many were dropped."""
        dropped = self.live
        self._stop_listening()
        log.warning("proxy %s: cut (%d live connections dropped)", self.address, dropped)
        return dropped

    def heal(self) -> None:
        """Accept connections again, on the same port."""
        if self._closed:
            raise RuntimeError("the proxy is closed")
        if self._listener is None:
            self.start()
            log.warning("proxy %s: healed", self.address)

    def close(self) -> None:
        self._closed = True
        self._stop_listening()

    def __enter__(self) -> TcpProxy:
        return self if self._listener is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.close()
