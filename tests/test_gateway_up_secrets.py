"""`fleetbatch gateway up` keeps secrets off command lines and out of what it prints (issue 31, finding 10)."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from gateway.config import ClusterSpec
from gateway.deploy.supervisor import EngineSupervisor
from gateway.deploy.up import banner, write_private

SECRET_URL = "redis://:s3cret-pw-0123@127.0.0.1:1/0"


def test_engines_get_the_redis_url_in_their_environment_not_on_their_command_line(tmp_path):
    """A real ``fleetbatch engine serve`` process as ``fleetbatch gateway up`` starts it (forked by the fork server): any user of
    the host can read a command line (/proc/PID/cmdline, ps), which names the engine and no secret; the
    URL, password included, reaches the engine in its environment (it dials that "Redis" and logs in)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:  # accepts, never answers: the engine waits
        url = f"redis://:s3cret-pw-0123@127.0.0.1:{listener.getsockname()[1]}/0"
        sup = EngineSupervisor([ClusterSpec("c", engine_args=["--size", "nano"])], url, tmp_path)
        sup.start_all()
        try:
            listener.settimeout(60)
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(60)
                hello = conn.recv(4096)
                cmdline = Path(f"/proc/{sup.pids['c']}/cmdline").read_bytes().decode()
        finally:
            sup.stop()
    assert b"s3cret-pw-0123" in hello  # the password came through (the first command logs in)
    assert "engines.cli serve --cluster c" in cmdline and "s3cret" not in cmdline


def test_what_gateway_up_prints_masks_the_redis_password():
    info = {
        "address": "127.0.0.1:5",
        "redis_url": SECRET_URL,
        "clusters": ["fast"],
        "logs": "/tmp/logs",
        "admin_token_file": "/tmp/admin-token",
        "client_token_file": "/tmp/client-token",
    }
    text = banner(info)
    assert "s3cret" not in text and "redis://:***@127.0.0.1:1/0" in text and "/tmp/client-token" in text
    assert "none (--no-auth" in banner({**info, "client_token_file": None})


def test_private_files_are_replaced_whole_and_stay_the_owners(tmp_path):
    path = tmp_path / "gateway.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_private(path, '{"redis_url": "secret"}')
    assert path.read_text() == '{"redis_url": "secret"}'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["gateway.json"]  # no temp file left behind
