"""A local deployment for benchmarks: ``fleetbatch gateway up`` in a child process, its ``gateway.json``, a clean stop.

``with LocalDeployment(run_dir, ["--clusters", "clusters.yaml"]) as info:`` starts ``fleetbatch gateway up``
(embedded Redis, one engine per cluster, the gateway on a free port), waits until it has
written ``gateway.json`` (address, Redis URL, pids) and stops everything on exit (SIGINT,
then SIGKILL of its process group if it hangs). The children die with it whatever happens
(``fleetbatch gateway up`` asks the kernel for that), so a crashed benchmark leaves no engines behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from workqueue.embedded import PARENT_ENV


class LocalDeployment:
    def __init__(
        self,
        run_dir: str | os.PathLike,
        args: Sequence[str] = (),
        timeout_s: float = 600.0,
        quiet: bool = True,
    ):
        """``quiet``: ``fleetbatch gateway up``'s output goes to ``run_dir/up.log`` (else to this terminal)."""
        self.run_dir = Path(run_dir)
        self.quiet = quiet
        self.args = list(args)
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> dict:
        info_file = self.run_dir / "gateway.json"
        info_file.unlink(missing_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "up",
            "--listen",
            "127.0.0.1:0",
            "--run-dir",
            str(self.run_dir),
        ]
        with open(self.run_dir / "up.log", "ab") as log:
            out = log if self.quiet else None
            self.proc = subprocess.Popen(
                [*cmd, *self.args], stdout=out, stderr=subprocess.STDOUT if self.quiet else None,
                start_new_session=True, env={**os.environ, PARENT_ENV: str(os.getpid())},
            )  # fmt: skip
        deadline = time.monotonic() + self.timeout_s
        while not info_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"`fleetbatch gateway up` exited with code {self.proc.returncode}; see {self.run_dir / 'up.log'}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the deployment did not come up within {self.timeout_s:.0f} s")
            time.sleep(0.3)
        return json.loads(info_file.read_text())

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> dict:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
