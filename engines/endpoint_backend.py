"""The endpoint backend: a cluster's queries go to OpenAI-compatible inference servers the user already
runs (``fleetbatch engine serve --backend endpoint --endpoint-url URL ...``, or a cluster file's
``endpoints``), and come back through the same Redis queue as every other backend's.

:class:`EndpointEngine` is an :class:`~engines.interface.Engine`: the worker's step loop hands it
requests and takes finished outputs, while an event loop on its own thread streams each request to
an endpoint (:mod:`engines.endpoint_http`) under the flow control of :mod:`engines.endpoint_flow`: an
in-flight limit per endpoint climbed to its best throughput (:mod:`engines.endpoint_limit`), exponential
backoff of an endpoint that is overloaded, restarting or unreachable (the request waits and goes again,
to it or another endpoint, never failed for it), the least loaded endpoint first. The result carries the
server's ``usage`` and ``finish_reason``; the cluster's capacity is the completion tokens/s it measures.

A chat row goes to ``/v1/chat/completions`` with its own messages (the server applies its own chat
template), any other row to ``/v1/completions`` with its prompt (the server tokenizes it as it is,
with its BOS where its tokenizer adds one); the OpenAI fields the row carries go as given, and the
log-probabilities and tool calls that come back are kept in the result (:mod:`engines.endpoint_stream`).
A forced length is sent as ``max_tokens``: the API has no way to ignore the end of text.
When no endpoint has answered for ``give_up_s`` while queries wait, :meth:`EndpointEngine.step`
raises :class:`~engines.interface.EngineFailure`: the worker gives the queries back to the queue.

It is :class:`~engines.interface.Resumable` from text: the worker checkpoints each stream's text, a notice
closes the streams that will not finish and gives their text back, and a partial output claimed (or a stream
cut short) is continued through ``/v1/completions`` (:mod:`engines.endpoint_job`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import replace

import httpx

from engines.endpoint_flow import Lane, RateMeter, least_loaded, next_opening
from engines.endpoint_http import (
    Completion,
    Overloaded,
    Rejected,
    UsageOptionRefused,
    served_models,
    stream_completion,
)
from engines.endpoint_job import Job, chat_renderer
from engines.endpoint_settings import EndpointSettings
from engines.endpoint_stream import Answer
from engines.interface import EngineFailure, EngineStats, Request, RequestOutput
from workqueue.partial import Partial

log = logging.getLogger(__name__)

#: longest wait of one step for a finished request (the worker then hands over new ones)
STEP_WAIT_S = 0.05
#: tries of a request the server failed on (500, an error in the stream) before the row fails
SERVER_ERROR_TRIES = 3


class _Misconfigured(Exception):
    """The endpoints cannot serve this engine as configured (which model?): the engine stops."""


class EndpointEngine:
    """:class:`~engines.interface.Engine` over OpenAI-compatible endpoints (see the module's docstring).

    The worker's thread calls the Engine methods; everything else runs on the engine's event loop.
    They meet under one lock: requests held, outputs finished, and a snapshot of the stats."""

    def __init__(self, settings: EndpointSettings) -> None:
        self.settings = settings
        self.chat = chat_renderer(
            settings.tokenizer_dir
        )  # renders a chat row continued from a partial output
        self.lanes = [Lane.of(url, settings.flow) for url in settings.urls]
        self._headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._outputs: list[RequestOutput] = []
        self._held: dict[str, Job] = {}  # handed over and not yet returned by step(), nor suspended
        self._failure: str | None = None
        self._capacity = sum(lane.limit.slots for lane in self.lanes)
        self._stats = EngineStats()
        # the event loop's own
        self._waiting: deque[Job] = deque()
        self._running: dict[str, Job] = {}
        self._models: dict[str, str] = {}  # url -> the model's name there (asked when not configured)
        self._asking = asyncio.Lock()  # one /v1/models question at a time
        self._usage_option = {url: True for url in settings.urls}  # send stream_options.include_usage
        self._no_usage: set[str] = set()  # endpoints that sent no usage (said once)
        self._meter = RateMeter()
        self._stalled_since: float | None = None  # no endpoint has answered since
        self._last_problem = ""
        self._wake: asyncio.TimerHandle | None = None
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="endpoint-io", daemon=True)
        self._thread.start()
        timeout = httpx.Timeout(settings.timeout_s)
        self._client: httpx.AsyncClient = self._call(self._open_client(timeout))

    @classmethod
    def from_args(cls, args) -> EndpointEngine:
        """The engine of ``fleetbatch engine serve --backend endpoint`` (httpx's line per request left out of its log)."""
        logging.getLogger("httpx").setLevel(logging.WARNING)
        return cls(EndpointSettings.from_args(args))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _open_client(self, timeout: httpx.Timeout) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=timeout)

    # ------------------------------------------------------------------ the worker's side

    def add_request(self, request: Request) -> None:
        request.sampling.validate()
        job = Job.of(request, self.chat)
        with self._lock:
            if request.request_id in self._held:
                raise ValueError(f"request {request.request_id} is already running")
            self._held[request.request_id] = job
            if (
                self._failure is not None
            ):  # held, never sent: the next step fails and the worker gives it back
                return
        self._loop.call_soon_threadsafe(self._admit, job)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._held:
                return
        self._loop.call_soon_threadsafe(self._abort, request_id)

    def step(self) -> list[RequestOutput]:
        """The requests finished since the last step (waiting up to ``STEP_WAIT_S`` for one); raises
        :class:`EngineFailure` once the engine failed and every finished output was returned."""
        with self._finished:
            if not self._outputs and self._failure is None:
                self._finished.wait(STEP_WAIT_S)
            out, self._outputs = self._outputs, []
            for o in out:
                self._held.pop(o.request_id, None)
            if not out and self._failure is not None:
                raise EngineFailure(self._failure)
        return out

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._held)

    def free_slots(self) -> int:
        with self._lock:
            return 0 if self._failure is not None else max(0, self._capacity - len(self._held))

    def stats(self) -> EngineStats:
        with self._lock:
            return replace(self._stats)

    # ------------------------------------------------------------------ engines.interface.Resumable

    steps_generate = False  # the streams go on between steps

    def progress(self) -> dict[str, int]:
        """Tokens each held request generated so far (the stream's pieces, a resumed one's partial output too)."""
        with self._lock:
            return {rid: job.generated() for rid, job in self._held.items() if not job.done}

    def partial(self, request_id: str) -> Partial | None:
        """What a held request generated so far, as the partial output a continuation resumes from."""
        with self._lock:
            job = self._held.get(request_id)
            return None if job is None or job.done else job.partial()

    def suspend(self, request_id: str) -> Partial | None:
        """Take a request out without an output, its stream closed: what it generated (None: not held, or
        finished: :meth:`step` returns it)."""
        with self._lock:
            job = self._held.get(request_id)
            if job is None or job.done or job.answer.finish_reason:  # finished: step() returns its output
                return None
            job.suspended = True
            del self._held[request_id]
            taken = job.partial() or Partial()
        self._loop.call_soon_threadsafe(self._drop, job)
        return taken

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self._shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()

    async def _shutdown(self) -> None:
        self._closing = True
        tasks = [job.task for job in self._running.values() if job.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    # ------------------------------------------------------------------ the event loop's side

    def _admit(self, job: Job) -> None:
        if not self._waiting and not self._running:
            self._stalled_since = None  # the give-up clock runs while queries wait, not while idle
        self._waiting.append(job)
        self._dispatch()

    def _drop(self, job: Job) -> None:
        """A suspended request leaves: its stream closed, and its place in the queue (sent back there to retry)."""
        if job.task is not None:
            job.task.cancel()  # _send answers nothing for it (a task done already: nothing)
        if job in self._waiting:
            self._waiting.remove(job)
        self._publish()

    def _abort(self, request_id: str) -> None:
        job = self._running.get(request_id)
        if job is not None and job.task is not None:
            job.aborted = True
            job.task.cancel()  # closes its stream; _send answers it "abort"
            return
        for job in self._waiting:
            if job.request.request_id == request_id:
                self._waiting.remove(job)
                self._finish(job, job.empty("abort"))
                break
        self._publish()

    def _dispatch(self) -> None:
        """Send waiting requests to open endpoints, least loaded first; wake again when a backoff ends."""
        if self._closing:
            return
        now = time.monotonic()
        if self._failure is None:
            self._check_stall(now)
        while self._waiting and self._failure is None:
            lane = least_loaded(self.lanes, now)
            if lane is None:
                break
            job = self._waiting.popleft()
            if job.aborted:  # its abort came as it went back to wait
                self._finish(job, job.empty("abort"))
                continue
            if job.suspended:
                continue
            if job.left <= 0:  # its partial output took every token it may generate
                self._finish(job, job.ended())
                continue
            lane.inflight += 1
            self._running[job.request.request_id] = job
            job.task = self._loop.create_task(self._send(job, lane))
        self._meter.busy(now, len(self._running))
        self._publish()
        if self._waiting and self._failure is None:
            wait = next_opening(self.lanes, now)
            if wait is not None and self._wake is None:
                self._wake = self._loop.call_later(wait, self._woken)

    def _woken(self) -> None:
        self._wake = None
        self._dispatch()

    async def _send(self, job: Job, lane: Lane) -> None:
        window, sent_at = lane.limit.window, time.monotonic()
        try:
            model = await self._model_at(lane)
            sent = job.body(model, self._usage_option[lane.url])
            with self._lock:  # the worker's thread reads the job's answer (partial, progress)
                job.answer = Answer()  # each time from the start (or from its partial output)
            done = await stream_completion(self._client, lane.url, sent, self._headers, job.answer)
        except asyncio.CancelledError:  # aborted; or the engine failed or closes: the worker gives it back
            if job.aborted:
                self._finish(job, job.empty("abort"))
        except Overloaded as e:
            self._overloaded(lane, window, sent_at, e)
            with self._lock:
                job.carry_on()  # a stream cut short goes on from its text
            self._again(job)
        except UsageOptionRefused as e:
            log.warning("%s; asking it without stream_options from now on", e)
            self._usage_option[lane.url] = False
            self._again(job)
        except Rejected as e:
            self._answered(lane)
            if e.retryable and job.server_errors + 1 < SERVER_ERROR_TRIES:
                job.server_errors += 1
                log.warning("%s; trying request %s again", e, job.request.request_id)
                lane.backoff.failed(time.monotonic(), sent_at)
                self._again(job)
            else:
                self._finish(job, job.empty("error", error=str(e)))
        except _Misconfigured as e:
            self._again(job)
            self._fail(str(e))
        except Exception as e:  # a bug here must not lose the row: it fails, saying why
            log.exception("request %s failed in the endpoint backend", job.request.request_id)
            self._finish(job, job.empty("error", error=f"endpoint backend: {type(e).__name__}: {e}"))
        else:
            self._succeeded(job, lane, done)
        finally:
            lane.inflight -= 1
            self._running.pop(job.request.request_id, None)
            self._dispatch()

    def _again(self, job: Job) -> None:
        """Back to the front of the queue, to be sent again (unless it was suspended meanwhile)."""
        if not job.suspended:
            self._waiting.appendleft(job)

    async def _model_at(self, lane: Lane) -> str:
        if self.settings.model:
            return self.settings.model
        async with self._asking:  # one question at a time: the first answer serves the requests waiting
            if lane.url not in self._models:
                self._models[lane.url] = await self._model_listed(lane)
        return self._models[lane.url]

    async def _model_listed(self, lane: Lane) -> str:
        """The one model ``lane``'s ``/v1/models`` lists (several or none: the engine is misconfigured)."""
        names = await served_models(self._client, lane.url, self._headers)
        if len(names) != 1:
            raise _Misconfigured(
                f"{lane.url}/models lists {len(names)} models ({', '.join(names) or 'none'}): "
                "name the one to use with --served-model-name"
            )
        log.info("endpoint %s serves %s", lane.url, names[0])
        return names[0]

    def _succeeded(self, job: Job, lane: Lane, done: Completion) -> None:
        lane.backoff.succeeded()
        lane.limit.succeeded(done.completion_tokens, time.monotonic(), lane.inflight)
        self._answered(lane)
        self._meter.add(time.monotonic(), done.completion_tokens)
        if not done.usage_reported and not done.cut and lane.url not in self._no_usage:
            self._no_usage.add(lane.url)
            log.warning("%s sends no usage: its completions count the stream's pieces, prompts 0", lane.url)
        self._finish(job, job.output(done))

    def _overloaded(self, lane: Lane, window: int, sent_at: float, e: Overloaded) -> None:
        now = time.monotonic()
        halved = lane.limit.overloaded(window)
        wait = lane.backoff.failed(now, sent_at, e.retry_after_s)
        if self._stalled_since is None:
            self._stalled_since = now
        self._last_problem = str(e)
        log.log(
            logging.WARNING if halved else logging.INFO,
            "%s; asking it again in %.2f s, at most %d in flight (the request waits, it is not failed)",
            e,
            wait,
            lane.limit.slots,
        )

    def _answered(self, lane: Lane) -> None:
        if self._stalled_since is not None:
            log.info("%s answers again after %.1f s", lane.url, time.monotonic() - self._stalled_since)
            self._stalled_since = None

    def _check_stall(self, now: float) -> None:
        if self._stalled_since is not None and now - self._stalled_since >= self.settings.give_up_s:
            self._fail(
                f"no endpoint answered for {self.settings.give_up_s:.0f} s (last: {self._last_problem})"
            )

    def _fail(self, why: str) -> None:
        with self._finished:
            if self._failure is None:
                self._failure = why
            self._finished.notify_all()
        for job in self._running.values():
            if job.task is not None:
                job.task.cancel()

    def _finish(self, job: Job, output: RequestOutput) -> None:
        with self._finished:
            if job.done or job.suspended:  # answered already, or given back under a notice
                return
            job.done = True
            self._outputs.append(output)
            self._finished.notify_all()

    def _publish(self) -> None:
        """The stats and free slots the worker reads, taken now."""
        stats = EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            tokens_per_s=self._meter.rate(),
            generated_tokens=self._meter.tokens,
        )
        with self._lock:
            self._capacity = sum(lane.limit.slots for lane in self.lanes)
            self._stats = stats
