"""An HTTP fault proxy for tests: a real asyncio server on a loopback port in front of a real server.

Each new connection takes the next fault of its list, then passes: a status (``"503"``, ``"400"``...)
reads the request and answers it with that status and an error body (and closes; ``"422"`` refuses
``stream_options`` as a strict server does), ``"hang"`` reads it and never answers (until the client
gives up and closes), ``"no-usage"`` answers a whole stream of two pieces without ``usage``, ``"cut"``
a stream that ends before its completion does, ``"finished-cut"`` a whole answer whose connection closes
before its usage and the end of its body, ``"stall-K"`` relays the request and the first K events of
its answer's stream (each ending in a blank line) and then nothing more, until the client closes (a server
that stops mid-answer, at a point a test chooses), ``"cut-K"`` the same first K events and then closes the
connection (a server killed mid-answer), and ``"pass"`` (when the list is used up) relays the connection's
bytes both ways untouched.
:meth:`FaultProxy.counts` counts the connections of each kind; :attr:`FaultProxy.heads` keeps the
heads of the requests it answered with a fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter, deque
from collections.abc import Iterable

#: the streams it answers itself
STREAMS = {
    "no-usage": b'data: {"choices": [{"index": 0, "text": "Hi"}]}\n\n'
    b'data: {"choices": [{"index": 0, "text": " there", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n',
    "cut": b'data: {"choices": [{"index": 0, "text": "Hi"}]}\n\n',
    # a whole answer, then the connection closed before its usage and end of stream (a body cut short)
    "finished-cut": b'data: {"choices": [{"index": 0, "text": "Hi"}]}\n\n'
    b'data: {"choices": [{"index": 0, "text": " there", "finish_reason": "stop"}]}\n\n',
}
#: the streams it cuts short: their Content-Length says this many bytes more than it sends
SHORT_BY = {"finished-cut": 100}
#: the error bodies of the statuses it answers (others: a generic one)
BODIES = {
    "422": b'{"detail": "Unexpected fields in the request: {\'stream_options\'}"}',
    "503": b'{"error": {"message": "overloaded (fault proxy)"}}',
}


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One HTTP request: its head (returned), and its body by ``Content-Length``."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if length:
        await reader.readexactly(length)
    return head


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _stall_pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, events: int, cut: bool = False
) -> None:
    """Relay the first ``events`` server-sent events (each ends in a blank line), then read on and relay
    nothing, the client's connection held open until the client closes it (``cut``: close it instead)."""
    seen, carry, held = 0, b"", False  # carry: the last byte of a read, where a blank line may begin
    try:
        while data := await reader.read(65536):
            if seen >= events:
                if cut:
                    break
                continue
            buf, pos = carry + data, 0
            while seen < events and (i := buf.find(b"\n\n", pos)) >= 0:
                seen, pos = seen + 1, i + 2
            carry = b"" if pos == len(buf) else buf[-1:]
            writer.write(data if seen < events else data[: pos - len(buf) + len(data)])
            await writer.drain()
        held = seen >= events and not cut  # the client's side closes it (then _handle does)
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        if not held:
            writer.close()


class FaultProxy:
    """See the module's docstring; :meth:`start` returns its port, :meth:`stop` ends it."""

    def __init__(self, upstream_port: int, faults: Iterable[str]) -> None:
        self.upstream_port = upstream_port
        self._faults = deque(faults)
        self.seen: Counter[str] = Counter()
        self.heads: list[bytes] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> int:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop
        ).result(timeout=10)
        return self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def counts(self) -> Counter[str]:
        with self._lock:
            return Counter(self.seen)

    def _keep(self, head: bytes) -> None:
        with self._lock:
            self.heads.append(head)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            fault = self._faults.popleft() if self._faults else "pass"
            self.seen[fault] += 1
        try:
            if fault.isdigit():
                self._keep(await _read_request(reader))
                body = BODIES.get(fault, f'{{"error": {{"message": "fault proxy: {fault}"}}}}'.encode())
                writer.write(
                    f"HTTP/1.1 {fault} Fault\r\nContent-Type: application/json\r\n".encode()
                    + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
            elif fault in STREAMS:
                self._keep(await _read_request(reader))
                body = STREAMS[fault]
                length = len(body) + SHORT_BY.get(fault, 0)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    + f"Content-Length: {length}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
            elif fault == "hang":
                self._keep(await _read_request(reader))
                while await reader.read(65536):  # until the client gives up
                    pass
            else:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
                kind, _, events = fault.partition("-")
                back = (
                    _stall_pipe(up_reader, writer, int(events), cut=kind == "cut")
                    if kind in ("stall", "cut")
                    else _pipe(up_reader, writer)
                )
                await asyncio.gather(_pipe(reader, up_writer), back)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            with contextlib.suppress(OSError):
                writer.close()
            self._tasks.discard(task)
