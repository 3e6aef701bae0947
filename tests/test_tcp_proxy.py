"""The harness's TCP proxy (load/tcp_proxy.py) on real loopback sockets: bytes pass unchanged,
delay and bandwidth slow a direction down (lower bounds only: a loaded machine only adds), the
cut drops live connections and refuses new ones, heal accepts again on the same port, and a
Redis client through it sees the partition as a connection error."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import redis

from load.tcp_proxy import Link, TcpProxy


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


def test_cut_drops_live_connections_refuses_new_ones_and_heal_accepts_again(echo):
    with TcpProxy(echo) as proxy:
        host, port = proxy.address.rsplit(":", 1)
        live = socket.create_connection((host, int(port)), timeout=30)
        live.sendall(b"ping")
        assert live.recv(4) == b"ping"
        deadline = time.monotonic() + 30
        while proxy.live != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.cut() == 1 and proxy.is_cut
        try:  # the live connection is closed under it: EOF or a reset, never an answer
            live.sendall(b"again")
            assert live.recv(5) == b""
        except OSError:
            pass
        live.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=30)
        proxy.heal()
        assert proxy.address == f"{host}:{port}"
        assert roundtrip(proxy.address, b"back") == b"back"


def test_a_redis_client_through_the_proxy_sees_the_partition(redis_url):
    path = redis_url.removeprefix("unix://")
    with TcpProxy(path) as proxy:  # a unix-socket upstream
        r = redis.Redis.from_url(f"redis://{proxy.address}/0", socket_timeout=10, socket_connect_timeout=10)
        r.set("proxied", "1")
        proxy.cut()
        with pytest.raises(redis.ConnectionError):
            r.get("proxied")
        proxy.heal()
        assert r.get("proxied") == b"1"  # redis-py reconnects on the next command
