"""A TCP proxy the harness controls: one-way delay and jitter, a bandwidth cap, and partitions.

``fleetbatch loadgen chaos`` puts one between an engine and Redis to partition them; it is also meant to
emulate a WAN link (issue 33). Each direction of a connection has its own :class:`Link`:

* ``delay_s`` and ``jitter_s``: every chunk read is held ``delay_s + U(0, jitter_s)`` seconds
  before it is forwarded, never overtaking the chunk before it (a TCP stream stays in order);
* ``bandwidth_bps``: bytes per second forwarded in that direction, per connection (0: no cap).

:meth:`TcpProxy.set_links` changes them at run time, live connections included. Each direction
holds at most :data:`QUEUE_CHUNKS` chunks: when its writer lags (a bandwidth cap, a partition),
its reader stops reading and the sender's kernel buffers fill, as on a real slow link.

:meth:`TcpProxy.cut` partitions, in one of two modes (:data:`BLACKHOLE` by default):

* ``blackhole``: packets vanish, as when a route or a firewall drops them. Live connections
  stay open and nothing is forwarded either way (reads on both ends hang); new connects are
  accepted and hang too. :meth:`TcpProxy.heal` lets it all flow again, as TCP retransmits after
  a short partition: held bytes are delivered, held connects reach the upstream.
* ``reset``: every live connection is reset (RST) and every new connect is accepted and reset.

The listening socket stays open from :meth:`start` to :meth:`close` (a heal never rebinds, so
no other process can take the port meanwhile). :meth:`stats` counts what the cuts did (the
chaos run's evidence that a partition bit). The upstream is ``(host, port)`` or a unix socket
path. Threads: one acceptor, per connection one reader and one writer per direction, and one
opener per connect held by a blackhole; all stop on :meth:`close`.
"""

from __future__ import annotations

import logging
import queue
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
QUEUE_CHUNKS = 8  # chunks one direction holds before its reader waits for its writer
POLL_S = 0.2  # how often a waiting thread looks whether its connection or the proxy closed
BLACKHOLE, RESET = "blackhole", "reset"
MODES = (BLACKHOLE, RESET)
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


def connect_upstream(upstream: Address, timeout_s: float = 5.0) -> socket.socket:
    """A connection to ``upstream`` (a Unix socket's path, or host and port), within ``timeout_s``."""
    family = socket.AF_UNIX if isinstance(upstream, str) else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(upstream)
    except OSError:
        s.close()
        raise
    s.settimeout(None)
    return s


def reset_socket(s: socket.socket, wake_reader: bool = False) -> None:
    """Close ``s`` with a RST (SO_LINGER 0), not a FIN; ``wake_reader``: shut it down first, which wakes a
    thread blocked reading it (a bare close would not)."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if wake_reader:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


class _Pipe:
    """One direction of one connection: a reader stamps chunks, a writer forwards them when due
    and while the proxy is not cut; at most :data:`QUEUE_CHUNKS` chunks wait between them."""

    def __init__(self, src: socket.socket, dst: socket.socket, link: Callable[[], Link], conn: _Connection):
        self.src, self.dst, self.link, self.conn = src, dst, link, conn
        self.chunks: queue.Queue[tuple[float, bytes] | None] = queue.Queue(maxsize=QUEUE_CHUNKS)
        self.threads = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._write, daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _put(self, item: tuple[float, bytes] | None) -> bool:
        """Queue ``item``, waiting for room (backpressure); False once the connection is gone."""
        while not self.conn.dead:
            try:
                self.chunks.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> None:
        last_due = 0.0
        try:
            while data := self.src.recv(CHUNK):
                last_due = max(last_due, time.monotonic() + self.link().hold_s(self.conn.proxy.rng))
                if not self._put((last_due, data)):
                    return
        except OSError:
            pass
        self._put(None)

    def _next(self) -> tuple[float, bytes] | None:
        while not self.conn.dead:
            try:
                return self.chunks.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return None

    def _write(self) -> None:
        try:
            while (item := self._next()) is not None:
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not self.conn.proxy.wait_flowing(self.conn):  # blackholed: hold until healed
                    break
                bandwidth = self.link().bandwidth_bps
                if bandwidth:
                    for i in range(0, len(data), 4096):  # paced in small slices
                        piece = data[i : i + 4096]
                        self.dst.sendall(piece)
                        time.sleep(len(piece) / bandwidth)
                else:
                    self.dst.sendall(data)
            else:
                self.dst.shutdown(socket.SHUT_WR)  # the source closed: pass the EOF on
        except OSError:
            pass
        self.conn.one_done()


class _Connection:
    def __init__(self, client: socket.socket, upstream: socket.socket, proxy: TcpProxy):
        self.sockets = (client, upstream)
        self.dead = False
        self._ends = 0
        self._lock = threading.Lock()
        self.proxy = proxy
        self.pipes = (
            _Pipe(client, upstream, lambda: proxy.up, self),
            _Pipe(upstream, client, lambda: proxy.down, self),
        )

    def start(self) -> None:
        for p in self.pipes:
            p.start()

    def one_done(self) -> None:
        with self._lock:
            self._ends += 1
            last = self._ends == 2
        if last:
            self.drop()

    def drop(self, rst: bool = False) -> None:
        self.dead = True
        for s in self.sockets:
            if rst:
                reset_socket(s)
                continue
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
        self.dropped = 0  # live connections reset by a ``reset`` cut
        self.refused = 0  # connects accepted and reset while a ``reset`` cut lasted
        self.blackholed = 0  # live connections frozen by a ``blackhole`` cut
        self.held_connects = 0  # connects accepted and held while a ``blackhole`` cut lasted
        self._mode: str | None = None  # the cut in force (None: healed)
        self._flowing = threading.Event()
        self._flowing.set()
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
        return self._mode is not None

    @property
    def mode(self) -> str | None:
        """The cut in force (``blackhole`` or ``reset``), None when healed."""
        return self._mode

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._live)

    def stats(self) -> dict[str, int]:
        """What the proxy saw so far: connects, and what the cuts did to connections."""
        return {
            "accepted": self.accepted,
            "dropped": self.dropped,
            "refused": self.refused,
            "blackholed": self.blackholed,
            "held_connects": self.held_connects,
            "refused_upstream": self.refused_upstream,
        }

    def start(self) -> TcpProxy:
        if self._listener is not None:
            raise RuntimeError("the proxy is already listening")
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.port))
        s.listen(128)
        self.port = s.getsockname()[1]
        self._listener = s
        self._acceptor = threading.Thread(target=self._accept, args=(s,), name="tcp-proxy", daemon=True)
        self._acceptor.start()
        return self

    def wait_flowing(self, conn: _Connection | None = None) -> bool:
        """Wait while a blackhole holds traffic; False once ``conn`` (or the proxy) is gone."""
        while not self._flowing.wait(POLL_S):
            if self._closed or (conn is not None and conn.dead):
                return False
        return not self._closed and not (conn is not None and conn.dead)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by close()
                return
            self.accepted += 1
            if self._mode == RESET:
                self.refused += 1
                reset_socket(client)
            elif self._mode == BLACKHOLE:  # accepted, and it hangs until healed
                self.held_connects += 1
                threading.Thread(
                    target=self._open, args=(client,), name="tcp-proxy-held", daemon=True
                ).start()
            else:
                self._open(client)

    def _open(self, client: socket.socket) -> None:
        """Connect ``client`` to the upstream (once traffic flows) and start forwarding."""
        if not self.wait_flowing() or self._mode == RESET:
            reset_socket(client)
            return
        try:
            upstream = connect_upstream(self.upstream, self.connect_timeout_s)
        except OSError as e:
            self.refused_upstream += 1
            log.debug("proxy %s: upstream %s unreachable: %s", self.address, self.upstream, e)
            client.close()
            return
        conn = _Connection(client, upstream, self)
        with self._lock:
            if self._closed or self._mode == RESET:  # cut or closed while it connected
                reset_socket(client)
                upstream.close()
                return
            self._live.add(conn)
        conn.start()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._live.discard(conn)

    def set_links(self, up: Link | None = None, down: Link | None = None) -> None:
        """Change a direction's impairments; live connections follow from their next chunk."""
        if up is not None:
            self.up = up
        if down is not None:
            self.down = down

    def cut(self, mode: str = BLACKHOLE) -> int:
        """Partition (see the module docstring); returns how many live connections it hit."""
        if mode not in MODES:
            raise ValueError(f"cut mode must be one of {', '.join(MODES)}, not {mode!r}")
        if self._closed:
            raise RuntimeError("the proxy is closed")
        with self._lock:
            self._mode = mode
            self._flowing.clear()
            live = list(self._live)
        if mode == RESET:
            for conn in live:
                conn.drop(rst=True)
            self.dropped += len(live)
        else:
            self.blackholed += len(live)
        log.warning("proxy %s: cut, %s (%d live connections)", self.address, mode, len(live))
        return len(live)

    def heal(self) -> None:
        """Forward again: blackholed bytes and held connects go through; new connects are served."""
        if self._closed:
            raise RuntimeError("the proxy is closed")
        if self._mode is not None:
            self._mode = None
            self._flowing.set()
            log.warning("proxy %s: healed", self.address)

    def close(self) -> None:
        self._closed = True
        self._flowing.set()  # wakes every waiting thread, which then sees the proxy closed
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

    def __enter__(self) -> TcpProxy:
        return self if self._listener is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.close()
