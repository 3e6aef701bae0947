"""The processes `fleetbatch loadgen chaos` runs and breaks: an embedded Redis it can kill and restart
(same data directory and socket) and gateway replicas it can kill and restart (same ports),
each with the OpenAI-compatible HTTP front on a shared files directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from workqueue.embedded import PARENT_ENV, EmbeddedRedis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RestartableRedis:
    """The embedded Redis (AOF, ``appendfsync everysec``) that comes back with its data after a SIGKILL."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.server = EmbeddedRedis(run_dir, persist=True)
        self.url = self.server.url

    def kill(self) -> None:
        self.server.kill()

    def restart(self) -> None:
        self.server = EmbeddedRedis(self.run_dir, persist=True)
        assert self.server.url == self.url

    def close(self) -> None:
        self.server.close()


class GatewayProcess:
    """One ``fleetbatch gateway serve`` replica on a fixed loopback port."""

    def __init__(
        self,
        name: str,
        redis_url: str,
        clusters_file: Path,
        token: str,
        log_dir: Path,
        *,
        client_token: str,
        files_dir: Path,
        http_key: str,
        env: dict[str, str] | None = None,
    ):
        self.name = name
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_port = free_port()
        self.http_url = f"http://127.0.0.1:{self.http_port}/v1"
        secrets = {  # in the environment, never on the command line
            "FLEETBATCH_HTTP_API_KEY": http_key,
            "FLEETBATCH_REDIS_URL": redis_url,
            "FLEETBATCH_ADMIN_TOKEN": token,
            "FLEETBATCH_CLIENT_TOKENS": f"chaos:{client_token}",
        }
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **secrets, **(env or {}))
        self.cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--listen",
            self.address,
            "--clusters",
            str(clusters_file),
            "--predictor",
            "heuristic",
            "--http-port",
            str(self.http_port),
            "--files",
            str(files_dir),
            "--chat-template",
            "default",
        ]  # fmt: skip  (restarts fast; the predictor is not under test; secrets from the environment; the
        # engines run the project's own random models, whose chat template is the documented default)
        self.log_path = log_dir / f"gateway-{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(  # not to outlive this harness, whose gRPC threads rule out a preexec_fn
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**self.env, PARENT_ENV: str(os.getpid())},
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as ch:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"gateway {self.name} exited with {self.proc.returncode}; see {self.log_path}"
                    )
                try:
                    grpc.channel_ready_future(ch).result(timeout=1.0)
                    return
                except grpc.FutureTimeoutError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"gateway {self.name} did not listen within {timeout_s:.0f} s"
                        ) from None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
