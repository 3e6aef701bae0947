"""Helpers for tests that run the real gateway (gRPC on loopback) and real engine processes."""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from gateway.checks.validation import Checked
from gateway.config import GatewayConfig
from gateway.deploy.forked import EngineProcess
from gateway.intake.background import encode_rows
from gateway.server import serve
from protos import fleetbatch_pb2 as pb
from workqueue import WorkQueue, keys
from workqueue.embedded import PARENT_ENV

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


def start_engine(cluster: str, redis_url: str, log_dir: Path, *extra: str) -> EngineProcess:
    """A real ``fleetbatch engine serve`` process (small random model) for ``cluster``, forked as
    ``fleetbatch gateway up`` forks its engines (:mod:`gateway.deploy.forked`): this test process's fork server
    imports the engine's code once, where each ``python -m engines.cli serve`` imported torch and transformers
    afresh (~5 s of CPU an engine). A real process all the same, with a pid to signal and an exit code; it
    gets SIGTERM when this test process ends, and SIGKILL if it is still there then (:func:`_kill_engines_left`)."""
    cmd = [sys.executable, "-m", "engines.cli", "serve", "--cluster", cluster, "--redis-url", redis_url]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
    log = log_dir / f"engine-{cluster}.log"
    log.touch()  # there from the start, as a spawned engine's was (tests wait on what it says)
    engine = EngineProcess([*cmd, "--threads", "1", *extra], env, str(log))
    _STARTED.add(engine)
    return engine


_STARTED: weakref.WeakSet[EngineProcess] = weakref.WeakSet()


@atexit.register  # before multiprocessing's own exit handler, which SIGTERMs them and waits without a timeout
def _kill_engines_left() -> None:
    """Engines a test left running (one stuck on a Redis that its fixture has stopped) cannot hold this process."""
    for engine in list(_STARTED):
        engine.kill()


def examples(ci: int) -> int:
    """Hypothesis examples of a property test: ``ci`` in the suite, ten times as many with
    ``FLEETBATCH_NIGHTLY=1`` (the long run that looks further than the suite's time allows)."""
    return ci * 10 if os.environ.get("FLEETBATCH_NIGHTLY") == "1" else ci


def derandomized() -> bool:
    """Hypothesis ``derandomize`` for a test that asserts what its examples covered (every status code, both roads):
    the suite draws the same examples on every run, so such an assertion cannot fail by chance (one run of the
    OpenAI front's fuzz drew no wrong token in 150 cases); ``FLEETBATCH_NIGHTLY=1`` draws new ones each run."""
    return os.environ.get("FLEETBATCH_NIGHTLY") != "1"


def serving_address(proc: subprocess.Popen) -> str:
    """The address a ``fleetbatch gateway serve`` process (stderr piped, as text) says it listens on."""
    for line in proc.stderr:
        m = re.search(r"gateway listening on (\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError("fleetbatch gateway serve never said where it listens")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def kill_when(engine: EngineProcess, ready, what: str, timeout: float = 120) -> None:
    """Wait until ``ready()`` (at most ``timeout``), then SIGKILL ``engine`` by its pid and reap it; killed and
    reaped whatever happens."""
    try:
        wait_until(ready, timeout, what)
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait(timeout=30)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


#: the random local models' shapes, as plan files name them
LOCAL_MODELS = {
    "nano": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 172},
    "tiny": {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "intermediate": 688},
}


def write_plan(
    path,
    size: str,
    cuts: list[int],
    bits: list[int],
    decode_mb: int = 2,
    prefill_mb: int = 2,
    slowdowns: list[float] | None = None,
    memory: int = 8 << 30,
    vocab: int = 8192,
    head_split: float = 0.0,
):
    """A plan file for llama:``size`` whose stage k holds layers [cuts[k], cuts[k+1]) on CPU device k."""
    from planfile import Plan, StagePlan, save_plan

    n = len(cuts) - 1
    slowdowns = slowdowns or [0.0] * n
    devices = [
        {
            "name": f"cpu{k}",
            "type": "CPU" if not slowdowns[k] else f"CPU@x{1 + slowdowns[k]:g}",
            "memory_bytes": memory,
            "node": "local",
            "slowdown": slowdowns[k],
        }
        for k in range(n)
    ]
    stages = [
        StagePlan(k, cuts[k], cuts[k + 1], bits[cuts[k] : cuts[k + 1]], 10**6, 0.01, 0.001) for k in range(n)
    ]
    plan = Plan(
        model={"name": f"llama:{size}", **LOCAL_MODELS[size], "layers": len(bits), "vocab": vocab},
        method="ilp",
        devices=devices,
        stages=stages,
        kv_bits=16,
        prefill_micro_batch=prefill_mb,
        decode_micro_batch=decode_mb,
        batch_size=8,
        prompt_len=32,
        expected_output_tokens=16,
        theta=1.0,
        total_omega=0.0,
        predicted_batch_latency_s=0.1,
        predicted_throughput_tokens_per_s=1000.0,
        solve_seconds=0.01,
        head_split=head_split,
    )
    save_plan(plan, path)
    return path


def batch_of(n: int, **kw) -> pb.SubmitBatchRequest:
    """A SubmitBatchRequest of ``n`` short queries ``q0..q{n-1}`` (``kw``: batch fields)."""
    req = pb.SubmitBatchRequest(**kw)
    for i in range(n):
        req.queries.add(id=f"q{i}", prompt=f"Explain topic number {i}.", max_tokens=8)
    return req


def accept(queue: WorkQueue, batch_id: str, n: int, prompt_tokens: int = 5) -> None:
    """Accept a batch of ``n`` rows for background intake, as SubmitBatch does for a large one."""
    req = pb.SubmitBatchRequest(batch_id=batch_id)
    for i in range(n):
        req.queries.add(id=f"q{i}", prompt=f"{batch_id} {i}", max_tokens=8)
    checked = Checked(prompt_tokens=[prompt_tokens] * n, max_tokens=[8] * n)
    assert queue.accept_batch(batch_id, encode_rows(req, checked), fingerprint="")


def enqueued(queue: WorkQueue, batch_id: str) -> int:
    """How many of a batch's rows intake has enqueued so far."""
    return int(queue.r.hget(keys.batch(batch_id), "intake_done") or 0)


class Clock:
    """A queue's (or finalizer's) clock, moved by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def restarting(queue: WorkQueue, name: str) -> None:
    """``name`` was alive once and sends no heartbeat now (its engine restarts, loading its model)."""
    queue.heartbeat(name, 30.0)
    queue.r.delete(keys.heartbeat(name))
