"""Helpers for tests that run the real gateway (gRPC on loopback) and real engine processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from gateway.config import GatewayConfig
from gateway.server import serve

REPO = Path(__file__).resolve().parent.parent


class GatewayThread:
    """The real gateway server on a free loopback port, in a background event loop."""

    def __init__(self, config: GatewayConfig):
        config.listen = "127.0.0.1:0"
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            ready = asyncio.Event()
            task = asyncio.create_task(serve(self.config, ready=ready, stop=self._stop))
            waiter = asyncio.create_task(ready.wait())
            await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
            self._ready.set()
            await task

        try:
            self._loop.run_until_complete(main())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()

    def start(self, timeout: float = 120) -> str:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("gateway did not start")
        if self._error:
            raise self._error
        return self.config.bound_address

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


def start_engine(cluster: str, redis_url: str, log_dir: Path, *extra: str) -> subprocess.Popen:
    """A real ``engine serve`` process (small random model) for ``cluster``."""
    log = open(log_dir / f"engine-{cluster}.log", "ab")  # noqa: SIM115 - owned by the child
    cmd = [
        sys.executable,
        "-m",
        "engines.cli",
        "serve",
        "--cluster",
        cluster,
        "--redis-url",
        redis_url,
        "--threads",
        "1",
        *extra,
    ]
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
