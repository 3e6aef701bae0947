"""A TCP proxy in front of Redis that loses a reply *after Redis ran the command*: the fault of a WAN where
a command arrives, runs, and its reply never comes back (a reset, a stall past the reply timeout).

It forwards both directions and reads enough RESP to pair each reply with its request, in order, per
connection (:class:`RespCounter`: it counts complete top-level messages and keeps the first two
arguments of each command). :meth:`ReplyCutProxy.arm` names a kind of call (a command and its first
argument: ``EVALSHA`` and a script's SHA, say); when the reply to such a call has come back from Redis
whole (so the call ran), the proxy forwards the replies before it, drops that one and resets the
client's connection (RST). The client (redis-py) sees a connection error and, by its retry policy,
sends the call, or the whole pipeline, again. A ``reply`` predicate restricts the cut to replies it
accepts (a claim that handed out queries); a call inside ``MULTI`` counts at its ``EXEC``. Connections
that subscribe (pub/sub) are passed through untouched. :attr:`ReplyCutProxy.hits` keeps each cut, with
the reply that was lost (:func:`decode` reads it).

Used by ``fleetbatch loadgen chaos`` (:mod:`load.chaos.faults_wide`) on an engine's link and on the
gateways' link; :mod:`load.tcp_proxy` holds the link faults (delay, partitions).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from load.tcp_proxy import Address, connect_upstream, reset_socket

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
KEEP_ARG_BYTES = 256  # a command's argument longer than this is not kept (a SHA is 40)
HELD_MAX = 4 << 20  # a marked reply longer than this is forwarded as it comes (and not cut)
PUBSUB = {b"SUBSCRIBE", b"PSUBSCRIBE", b"SSUBSCRIBE", b"MONITOR"}


class RespCounter:
    """Counts complete top-level RESP messages in a stream fed in pieces; keeps the first ``keep_args`` short
    bulk strings of each top-level array (a command's name and first argument). O(bytes): a bulk string is
    skipped by its length, never parsed again."""

    def __init__(self, keep_args: int = 0):
        self.keep_args = keep_args
        self.stack: list[int] = []  # elements still to come in each open aggregate
        self.skip = 0  # bytes of a bulk string (and its CRLF) still to pass
        self.line = b""  # the start of a header line cut by a piece's end
        self.args: list[bytes] = []
        self.capture: bytearray | None = None
        self.index = 0  # elements of the current top-level array complete so far

    def feed(self, data: bytes) -> list[tuple[int, list[bytes]]]:
        """The messages ``data`` completes: the offset in ``data`` just past each, and its kept arguments."""
        out: list[tuple[int, list[bytes]]] = []
        i, n = 0, len(data)
        while i < n:
            if self.skip:
                take = min(self.skip, n - i)
                if self.capture is not None:
                    self.capture += data[i : i + take]
                i += take
                self.skip -= take
                if not self.skip:
                    if self.capture is not None:
                        self.args.append(bytes(self.capture[:-2]))
                        self.capture = None
                    self._element(i, out)
                continue
            j = data.find(b"\n", i)
            if j < 0:
                self.line += data[i:]
                break
            line = self.line + data[i : j + 1] if self.line else data[i : j + 1]
            self.line = b""
            i = j + 1
            kind, rest = line[:1], line[1:].rstrip(b"\r\n")
            if kind in (b"$", b"=", b"!"):
                size = int(rest)
                if size < 0:
                    self._element(i, out)
                    continue
                self.skip = size + 2
                if len(self.stack) == 1 and self.index < self.keep_args and size <= KEEP_ARG_BYTES:
                    self.capture = bytearray()
            elif kind in (b"*", b"~", b">", b"%"):
                size = int(rest) * (2 if kind == b"%" else 1)
                if size <= 0:
                    self._element(i, out)
                else:
                    self.stack.append(size)
            else:  # + - : _ , # ( : one line
                self._element(i, out)
        return out

    def _element(self, end: int, out: list) -> None:
        while self.stack:
            if len(self.stack) == 1:
                self.index += 1
            self.stack[-1] -= 1
            if self.stack[-1] > 0:
                return
            self.stack.pop()
        out.append((end, self.args))
        self.args, self.index = [], 0


def decode(data: bytes):
    """One complete RESP2 message as Python values (bulk strings as bytes, errors as ``Exception``)."""

    def at(i: int):
        j = data.index(b"\r\n", i)
        kind, rest = data[i : i + 1], data[i + 1 : j]
        if kind == b"$":
            size = int(rest)
            return (None, j + 2) if size < 0 else (data[j + 2 : j + 2 + size], j + 4 + size)
        if kind == b"*":
            size, items, k = int(rest), [], j + 2
            for _ in range(max(0, size)):
                item, k = at(k)
                items.append(item)
            return (items if size >= 0 else None), k
        if kind == b":":
            return int(rest), j + 2
        if kind == b"-":
            return Exception(rest.decode("utf-8", "replace")), j + 2
        return rest, j + 2

    return at(0)[0]


@dataclass
class Rule:
    name: str
    command: bytes
    arg: bytes | None  # the first argument it must have (None: any)
    times: int  # cuts left
    reply: Callable[[bytes], bool] | None = None  # cut only a reply this accepts


@dataclass
class Hit:
    rule: str
    reply: bytes  # the reply that was lost (at most HELD_MAX bytes)
    at: float = field(default_factory=time.monotonic)


class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket, proxy: ReplyCutProxy):
        self.client, self.upstream, self.proxy = client, upstream, proxy
        self.pending: collections.deque[str | None] = collections.deque()  # per request: the rule it names
        self.pubsub = False
        self.multi: list[str] | None = None  # rules named inside MULTI (they count at EXEC)
        self.dead = False

    def start(self) -> None:
        for target in (self._requests, self._replies):
            threading.Thread(target=target, daemon=True, name="reply-cut").start()

    def _name(self, args: list[bytes]) -> str | None:
        cmd = args[0].upper() if args else b""
        if cmd in PUBSUB:
            self.pubsub = True
        if cmd == b"MULTI":
            self.multi = []
            return None
        if cmd in (b"EXEC", b"DISCARD"):
            named, self.multi = self.multi or [], None
            return named[0] if named and cmd == b"EXEC" else None
        name = self.proxy.match(cmd, args[1] if len(args) > 1 else None)
        if name is not None and self.multi is not None:
            self.multi.append(name)
            return None
        return name

    def _requests(self) -> None:
        counter = RespCounter(keep_args=2)
        try:
            while data := self.client.recv(CHUNK):
                if not self.pubsub:
                    for _, args in counter.feed(data):
                        self.pending.append(self._name(args))
                self.upstream.sendall(data)
            self.upstream.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        except ValueError:  # not RESP: pass it on, never cut it
            self.pubsub = True
            self._pass(self.client, self.upstream)

    def _pass(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(CHUNK):
                dst.sendall(data)
        except OSError:
            pass

    def _replies(self) -> None:
        counter, held = RespCounter(), b""
        try:
            while data := self.upstream.recv(CHUNK):
                if self.pubsub:
                    self.client.sendall(held + data)
                    held = b""
                    self._pass(self.upstream, self.client)
                    break
                out, pos = [], 0
                for end, _ in counter.feed(data):
                    name = self.pending.popleft() if self.pending else None
                    piece, pos = held + data[pos:end], end
                    held = b""
                    if name is not None and self.proxy.should_cut(name, piece):
                        self.client.sendall(b"".join(out))
                        self.cut()
                        return
                    out.append(piece)
                rest = data[pos:]
                if self.pending and self.pending[0] is not None and len(held) + len(rest) <= HELD_MAX:
                    held += rest  # a marked reply not yet whole: held until it is
                else:
                    out.append(held + rest)
                    held = b""
                self.client.sendall(b"".join(out))
            self.client.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        except ValueError:
            self.client.sendall(held)
            self._pass(self.upstream, self.client)
        self.close()

    def cut(self) -> None:
        self.dead = True
        reset_socket(self.client, wake_reader=True)
        reset_socket(self.upstream, wake_reader=True)
        self.proxy.forget(self)

    def close(self) -> None:
        if self.dead:
            return
        self.dead = True
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.proxy.forget(self)


class ReplyCutProxy:
    """``ReplyCutProxy(upstream).start()``; clients connect to :attr:`address`; :meth:`arm` a kind of call,
    :meth:`hit_count` tells how many of its replies were lost so far."""

    def __init__(self, upstream: Address, host: str = "127.0.0.1"):
        self.upstream, self.host, self.port = upstream, host, 0
        self.rules: dict[str, Rule] = {}
        self.hits: dict[str, list[Hit]] = {}
        self.accepted = 0
        self._lock = threading.Lock()
        self._live: set[_Conn] = set()
        self._listener: socket.socket | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{self.address}/0"

    def start(self) -> ReplyCutProxy:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, 0))
        s.listen(128)
        self.port = s.getsockname()[1]
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True, name="reply-cut-accept").start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                upstream = connect_upstream(self.upstream)
            except OSError:
                client.close()  # Redis down: the client sees a closed connection, as without the proxy
                continue
            conn = _Conn(client, upstream, self)
            with self._lock:
                self._live.add(conn)
            conn.start()

    def forget(self, conn: _Conn) -> None:
        with self._lock:
            self._live.discard(conn)

    def arm(
        self,
        name: str,
        command: bytes,
        arg: bytes | None = None,
        times: int = 1,
        reply: Callable[[bytes], bool] | None = None,
    ) -> None:
        """Lose the replies of the next ``times`` calls of ``command`` (with first argument ``arg``) whose reply
        ``reply`` accepts (each: the call ran, its reply dropped, the client's connection reset)."""
        with self._lock:
            self.rules[name] = Rule(name, command.upper(), arg, times, reply)
            self.hits.setdefault(name, [])

    def disarm(self, name: str | None = None) -> None:
        """Stop cutting ``name``'s calls (every kind when None); the hits are kept."""
        with self._lock:
            for rule in [self.rules[name]] if name is not None else list(self.rules.values()):
                rule.times = 0

    def match(self, command: bytes, arg: bytes | None) -> str | None:
        for rule in list(self.rules.values()):
            if rule.times > 0 and rule.command == command and (rule.arg is None or rule.arg == arg):
                return rule.name
        return None

    def should_cut(self, name: str, reply: bytes) -> bool:
        with self._lock:
            rule = self.rules.get(name)
            if rule is None or rule.times <= 0:
                return False
        if rule.reply is not None and not rule.reply(reply):
            return False
        with self._lock:
            if rule.times <= 0:
                return False
            rule.times -= 1
            self.hits[name].append(Hit(name, reply))
        log.warning("reply-cut proxy %s: lost the reply to a %s call after it ran", self.address, name)
        return True

    def hit_count(self, name: str) -> int:
        with self._lock:
            return len(self.hits.get(name, ()))

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            live = list(self._live)
        for conn in live:
            conn.close()
