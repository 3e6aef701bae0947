"""The harness's TCP proxy (load/tcp_proxy.py) on real loopback sockets: bytes pass unchanged,
delay and bandwidth slow a direction down (lower bounds only: a loaded machine only adds), a
slow writer holds its reader back (bounded buffer), a blackhole cut freezes live connections
and holds new connects until the heal delivers everything, a reset cut resets both, the port
stays bound across a cut, and a Redis client through it sees each partition."""

from __future__ import annotations

import errno
import random
import select
import socket
import threading
import time

import pytest
import redis

from load.tcp_proxy import Link, TcpProxy
from tests.harness import wait_until


@pytest.fixture
def echo():
    """A real echo server on loopback; yields its (host, port)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()
    srv.close()


def roundtrip(address: str, payload: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while data := s.recv(65536):
            out += data
    return out


def test_bytes_pass_unchanged_both_ways(echo):
    payload = random.Random(0).randbytes(1_000_000)
    with TcpProxy(echo) as proxy:
        assert roundtrip(proxy.address, payload) == payload
        assert proxy.accepted == 1


def test_one_way_delay_and_jitter_hold_each_direction(echo):
    up, down = Link(delay_s=0.2, jitter_s=0.1), Link(delay_s=0.1)
    rng = random.Random(1)
    assert all(0.2 <= up.hold_s(rng) <= 0.3 for _ in range(1000))
    with TcpProxy(echo, up=up, down=down, seed=1) as proxy:
        t0 = time.monotonic()
        assert roundtrip(proxy.address, b"x" * 100) == b"x" * 100
        assert time.monotonic() - t0 >= 0.3  # 0.2 there, 0.1 back, at least
        # many small writes: held, never reordered
        host, port = proxy.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            for i in range(200):
                s.sendall(f"{i:04d}".encode())
            s.shutdown(socket.SHUT_WR)
            out = b""
            while data := s.recv(65536):
                out += data
        assert out == b"".join(f"{i:04d}".encode() for i in range(200))


def test_links_change_on_a_live_connection(echo):
    with TcpProxy(echo) as proxy:
        host, port = proxy.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"a")
            assert s.recv(1) == b"a"
            proxy.set_links(down=Link(delay_s=0.3))
            t0 = time.monotonic()
            s.sendall(b"b")
            assert s.recv(1) == b"b"
            assert time.monotonic() - t0 >= 0.3


def test_bandwidth_cap_paces_a_direction(echo):
    with TcpProxy(echo, up=Link(bandwidth_bps=100_000)) as proxy:
        t0 = time.monotonic()
        assert roundtrip(proxy.address, b"y" * 50_000) == b"y" * 50_000
        assert time.monotonic() - t0 >= 0.5  # 50 kB at 100 kB/s


def test_bad_knobs_are_refused():
    with pytest.raises(ValueError, match="delay_s"):
        Link(delay_s=-1)
    with pytest.raises(ValueError, match="bandwidth_bps"):
        Link(bandwidth_bps=float("inf"))


def connected(proxy: TcpProxy) -> socket.socket:
    host, port = proxy.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def live_connection(proxy: TcpProxy) -> socket.socket:
    """A connection through the proxy that has carried a round trip and that the proxy counts live."""
    live = connected(proxy)
    live.sendall(b"ping")
    assert live.recv(4) == b"ping"
    wait_until(lambda: proxy.live == 1, 30, "the proxy to count the connection", interval=0.01)
    return live


def test_a_slow_writer_holds_its_reader_back(echo):
    """A 1 kB/s cap: the proxy reads at most its bounded queue ahead, so the sender blocks after a
    few MB (kernel buffers); an unbounded queue would swallow all 64 MB at once."""
    with TcpProxy(echo, up=Link(bandwidth_bps=1000)) as proxy:
        s = connected(proxy)
        s.setblocking(False)
        sent, chunk = 0, b"z" * 65536
        while sent < 64 * 2**20:
            _, writable, _ = select.select([], [s], [], 5.0)
            if not writable:
                break  # blocked for 5 s: the proxy stopped reading
            try:
                sent += s.send(chunk)
            except BlockingIOError:
                continue
        assert sent < 32 * 2**20, f"the proxy read {sent} bytes ahead of a 1 kB/s link"
        s.close()


def test_a_blackhole_freezes_live_connections_holds_new_ones_and_heal_delivers_everything(echo):
    with TcpProxy(echo) as proxy:
        live = live_connection(proxy)
        assert proxy.cut() == 1 and proxy.mode == "blackhole"
        live.sendall(b"lost?")
        late = connected(proxy)  # accepted: the connect itself succeeds, then nothing comes back
        late.sendall(b"late")
        for s in (live, late):
            s.settimeout(1.0)
            with pytest.raises(TimeoutError):
                s.recv(16)  # nothing is forwarded while it lasts
            s.settimeout(30)
        assert proxy.stats()["blackholed"] == 1 and proxy.stats()["held_connects"] == 1
        proxy.heal()
        assert live.recv(5) == b"lost?" and late.recv(4) == b"late"
        live.close()
        late.close()


def test_a_reset_cut_resets_live_connections_and_new_connects(echo):
    with TcpProxy(echo) as proxy:
        live = live_connection(proxy)
        assert proxy.cut("reset") == 1 and proxy.is_cut
        with pytest.raises(ConnectionResetError):  # reset under it, never an answer
            live.sendall(b"again")
            assert live.recv(5) == b""
        live.close()
        with pytest.raises(ConnectionResetError):  # the reset may come at the connect itself on loopback
            with connected(proxy) as refused:
                refused.sendall(b"x")
                assert refused.recv(1) == b""
        assert proxy.stats()["dropped"] == 1 and proxy.stats()["refused"] == 1
        proxy.heal()
        assert roundtrip(proxy.address, b"back") == b"back"
        with pytest.raises(ValueError, match="mode"):
            proxy.cut("drop")


def test_the_port_stays_bound_across_a_cut(echo):
    """A heal never rebinds: nobody can take the port while the proxy is cut."""
    with TcpProxy(echo) as proxy:
        port = int(proxy.address.rsplit(":", 1)[1])
        for mode in ("blackhole", "reset"):
            proxy.cut(mode)
            other = socket.socket()
            with pytest.raises(OSError) as e:
                other.bind(("127.0.0.1", port))
            other.close()
            assert e.value.errno == errno.EADDRINUSE
            proxy.heal()
            assert roundtrip(proxy.address, b"same port") == b"same port"


def test_a_redis_client_through_the_proxy_sees_the_partition(redis_url):
    path = redis_url.removeprefix("unix://")
    with TcpProxy(path) as proxy:  # a unix-socket upstream
        r = redis.Redis.from_url(f"redis://{proxy.address}/0", socket_timeout=1, socket_connect_timeout=10)
        r.set("proxied", "1")
        proxy.cut("reset")
        with pytest.raises(redis.ConnectionError):
            r.get("proxied")
        proxy.heal()
        assert r.get("proxied") == b"1"  # redis-py reconnects on the next command
        proxy.cut()  # a blackhole: only a socket timeout gets the client out
        with pytest.raises(redis.TimeoutError):
            r.get("proxied")
        proxy.heal()
        assert r.get("proxied") == b"1"


def test_the_queue_client_never_hangs_on_a_blackholed_redis(redis_url, monkeypatch):
    """``workqueue.connect``'s client gives up on a reply that does not come (a partition that drops
    packets) with a TimeoutError, after its few retries, instead of waiting for the heal; the
    worker's backoff and the gateway's UNAVAILABLE take it from there."""
    from workqueue import connect

    monkeypatch.setenv("FLEETBATCH_REDIS_TIMEOUT_S", "0.5")
    with TcpProxy(redis_url.removeprefix("unix://")) as proxy:
        r = connect(f"redis://{proxy.address}/0")
        r.set("proxied", "1")
        proxy.cut()  # a blackhole
        outcome: list[BaseException | str] = []

        def call() -> None:
            try:
                outcome.append(r.get("proxied"))
            except BaseException as e:  # noqa: BLE001 - what the call ended with is the result
                outcome.append(e)

        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(60)  # a bound on the test, not a timing assertion
        stuck = t.is_alive()
        proxy.heal()
        t.join(60)
        assert not stuck, "the call was still waiting on the blackholed Redis after 60 s"
        assert len(outcome) == 1 and isinstance(outcome[0], redis.TimeoutError), outcome
        assert r.get("proxied") == "1"  # and it reconnects once the partition heals


def test_the_queue_clients_timeout_is_checked():
    from workqueue.embedded import client_options

    mp = pytest.MonkeyPatch()
    try:
        for bad in ("0", "-1", "soon", "1e9"):
            mp.setenv("FLEETBATCH_REDIS_TIMEOUT_S", bad)
            with pytest.raises(ValueError, match="FLEETBATCH_REDIS_TIMEOUT_S"):
                client_options()
    finally:
        mp.undo()
