"""`gateway up` keeps secrets off command lines and out of what it prints (issue 31, finding 10)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from gateway.config import ClusterSpec
from gateway.deploy.supervisor import EngineSupervisor
from gateway.deploy.up import banner, write_private

SECRET_URL = "redis://:s3cret-pw-0123@127.0.0.1:1/0"


def test_engines_get_the_redis_url_in_their_environment_not_on_their_command_line(tmp_path):
    """A real ``engine serve`` process as ``gateway up`` starts it: any user of the host can read a
    command line (/proc/PID/cmdline, ps), only the owner its environment."""
    sup = EngineSupervisor([ClusterSpec("c", engine_args=["--size", "nano"])], SECRET_URL, tmp_path)
    sup.start_all()
    try:
        pid = sup.pids["c"]
        # while the child is in execve its command line reads empty: read it once exec is done
        deadline = time.monotonic() + 60
        while (
            not (cmdline := Path(f"/proc/{pid}/cmdline").read_bytes().decode())
            and time.monotonic() < deadline
        ):
            assert sup.procs["c"].poll() is None, Path(tmp_path / "engine-c.log").read_text()
            time.sleep(0.01)
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    finally:
        sup.stop()
    assert "engines.cli" in cmdline and "s3cret" not in cmdline
    assert f"FLEETBATCH_REDIS_URL={SECRET_URL}" in environ


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
