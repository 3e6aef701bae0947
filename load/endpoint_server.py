"""A real ``transformers serve`` of a local model directory, run as a process and stopped or killed by its pid.

:class:`EndpointServer` runs ``transformers serve MODEL_DIR`` on a free loopback port (CPU, float32),
waits until it answers ``/health``, and can start again on the same port after :meth:`kill` (a crash)
or :meth:`stop`. ``cpus`` pins it (``taskset -c``, else the affinity set in the child before it
starts) so that it computes on those cores alone. The endpoint backend's tests
(``tests/endpoint_server.py``) and ``fleetbatch loadgen endpoints`` use it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _pinned(cpus: Sequence[int] | None):
    """A ``preexec_fn`` that pins the child to ``cpus`` before it execs (None: no pinning)."""
    if not cpus:
        return None
    wanted = set(cpus)
    return lambda: os.sched_setaffinity(0, wanted)


class EndpointServer:
    """``transformers serve`` of one model directory on 127.0.0.1 (see the module's docstring)."""

    def __init__(
        self, model_dir: Path, log_dir: Path, *extra: str, cpus: Sequence[int] | None = None, threads: int = 1
    ) -> None:
        self.model_dir, self.log_dir, self.extra = Path(model_dir), Path(log_dir), extra
        self.cpus, self.threads = tuple(cpus or ()), threads
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        """The OpenAI base URL."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model(self) -> str:
        """The model's name at the server (the directory it was given)."""
        return str(self.model_dir)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"transformers-serve-{self.port}.log"

    def command(self) -> list[str]:
        cmd = [
            str(Path(sys.executable).with_name("transformers")), "serve", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
            "--log-level", "warning", *self.extra,
        ]  # fmt: skip
        taskset = shutil.which("taskset")
        if self.cpus and taskset:  # taskset execs the server: the pid stays the server's
            cmd = [taskset, "-c", ",".join(map(str, self.cpus)), *cmd]
        return cmd

    def start(self, timeout_s: float = 240) -> str:
        """Start the server and wait until it answers; returns its base URL."""
        self.starts += 1
        threads = str(self.threads)
        env = dict(
            os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
        )  # fmt: skip
        cmd = self.command()
        preexec = None if cmd[0].endswith("taskset") else _pinned(self.cpus)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=preexec
            )
        deadline = time.monotonic() + timeout_s
        while not _answers(self.url.removesuffix("/v1") + "/health"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited ({self.proc.returncode}): {self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"transformers serve did not answer in {timeout_s:.0f} s: {self.log_tail()}"
                )
            time.sleep(0.2)
        return self.url

    def kill(self) -> None:
        """SIGKILL the server by its pid (as a crash would end it) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s, by its pid."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@contextlib.contextmanager
def endpoint_server(model_dir: Path, log_dir: Path, *extra: str, **kw) -> Iterator[EndpointServer]:
    """A started :class:`EndpointServer`, stopped at the end (``kw``: its ``cpus`` and ``threads``)."""
    server = EndpointServer(model_dir, log_dir, *extra, **kw)
    server.start()
    try:
        yield server
    finally:
        server.stop()
