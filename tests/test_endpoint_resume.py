"""Issue 49, item 4 for the endpoint backend: a query checkpointed from its stream's text, preempted or killed,
and continued from that text through ``/v1/completions`` on another cluster.

Real parts: a real ``transformers serve`` (tests/endpoint_server.py) of a model whose text tokenizes back to the
tokens it generated (the byte model: so a continuation can equal the uninterrupted answer, and does) and, in front
of it, a real proxy that relays
the first K events of an answer and then nothing more (tests/fault_proxy.py, ``stall-K``): the stream stops at a
point the test chooses, whatever the machine's speed. A real Redis; in-process workers with their own step loops
and queue agents; for the hard kill a real ``fleetbatch engine serve --backend endpoint`` killed by its pid."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from engines.endpoint_backend import EndpointEngine
from engines.endpoint_settings import EndpointSettings
from engines.endpoint_stream import COMPLETIONS_PATH
from engines.interface import Request, RequestOutput, SamplingParams
from engines.metrics import WorkerCollector
from engines.worker import Worker, WorkerConfig
from gateway.offload.offloader import Offloader
from tests.endpoint_server import byte_model_dir, endpoint_server
from tests.fault_proxy import FaultProxy
from tests.harness import kill_when, start_engine, wait_until
from workqueue import QueryResult, QueuedQuery, WorkQueue, connect, keys
from workqueue.invariants import check
from workqueue.partial import Partial

# one worker runs the module, so one transformers serve starts (each costs a model load)
pytestmark = [pytest.mark.fault, pytest.mark.xdist_group("endpoint-resume")]

PROMPT = "Tell me about the river number 3."
MAX_TOKENS = 300
CUT = 20  # events the stalled streams get


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with endpoint_server(byte_model_dir(tmp_path_factory), tmp_path_factory.mktemp("serve")) as s:
        yield s


def stalled(server, streams: int, fault: str = "stall") -> tuple[FaultProxy, str]:
    """A proxy whose first ``streams`` answers stop after :data:`CUT` events (``fault`` "cut": and close), and its
    base URL."""
    proxy = FaultProxy(int(server.url.rsplit(":", 1)[1].split("/")[0]), [f"{fault}-{CUT}"] * streams)
    return proxy, f"http://127.0.0.1:{proxy.start()}/v1"


def engine_at(url: str, server, tokenizer_dir: str | None = None) -> EndpointEngine:
    settings = EndpointSettings(urls=(url,), model=server.model, timeout_s=120.0, tokenizer_dir=tokenizer_dir)
    return EndpointEngine(settings)


def run_to_end(engine: EndpointEngine, request: Request) -> RequestOutput:
    engine.add_request(request)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        for out in engine.step():
            if out.request_id == request.request_id:
                return out
    raise AssertionError(f"{request.request_id} did not finish")


def answer(url: str, server, request: Request, tokenizer_dir: str | None = None) -> RequestOutput:
    """``request`` run to its end on an engine of its own (closed after)."""
    engine = engine_at(url, server, tokenizer_dir)
    try:
        return run_to_end(engine, request)
    finally:
        engine.close()


def served(server, prompt: str, max_tokens: int) -> dict:
    """The server's own greedy answer to ``prompt`` (not streamed): its text and usage."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(server.url + COMPLETIONS_PATH, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return {"text": reply.json()["choices"][0]["text"], **reply.json()["usage"]}


def sampling() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS)


def test_an_answer_whose_connection_closes_after_its_end_is_whole(server):
    """The finish came, then the connection closed before the usage and the end of the stream: the answer is kept
    as it is (it is not asked for again, nor continued past its end)."""
    proxy = FaultProxy(int(server.url.rsplit(":", 1)[1].split("/")[0]), ["finished-cut"])
    url = f"http://127.0.0.1:{proxy.start()}/v1"
    try:
        out = answer(url, server, Request("f", PROMPT, sampling()))
    finally:
        proxy.stop()
    assert (out.text, out.finish_reason, out.completion_tokens) == ("Hi there", "stop", 2)
    assert proxy.counts() == {"finished-cut": 1}


def test_a_suspended_stream_hands_out_its_text_and_the_continuation_completes_it(server):
    reference = answer(server.url, server, Request("ref", PROMPT, sampling()))
    proxy, url = stalled(server, 1)
    cut = engine_at(url, server)
    try:
        cut.add_request(Request("cut", PROMPT, sampling()))
        wait_until(lambda: cut.step() == [] and cut.progress().get("cut") == CUT, 60, "the stream stalled")
        partial = cut.partial("cut")
        taken = cut.suspend("cut")
        assert taken == partial and len(taken) == CUT and not taken.token_ids
        assert reference.text.startswith(taken.text) and taken.text  # greedy: the same first pieces
        assert cut.suspend("cut") is None and cut.progress() == {} and not cut.has_unfinished()
        assert cut.step() == [] and cut.free_slots() > 0  # no output comes for it
        wait_until(lambda: proxy.counts()[f"stall-{CUT}"] == 1, 10, "the stream")
    finally:
        cut.close()
        proxy.stop()
    resumed = answer(server.url, server, Request("res", PROMPT, sampling(), resume=taken))
    rest = served(server, PROMPT + taken.text, MAX_TOKENS - CUT)  # what the server answers the continuation
    assert resumed.text == taken.text + rest["text"]
    assert resumed.completion_tokens == CUT + rest["completion_tokens"] <= MAX_TOKENS
    assert resumed.prompt_tokens == rest["prompt_tokens"] - CUT  # the partial text is not counted twice
    # a text that tokenizes back to its tokens (this model's): the uninterrupted answer, token for token
    assert (resumed.text, resumed.completion_tokens, resumed.prompt_tokens, resumed.finish_reason) == (
        reference.text,
        reference.completion_tokens,
        reference.prompt_tokens,
        reference.finish_reason,
    )


def test_a_chat_row_continues_as_the_server_would_have_answered_it(server, tmp_path_factory):
    """A chat row stalled on /v1/chat/completions, suspended, and continued through /v1/completions with its chat
    rendered by the served model's template (--endpoint-tokenizer): the uninterrupted chat answer."""
    tokenizer_dir = str(byte_model_dir(tmp_path_factory))
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]}

    def row(rid: str, resume: Partial | None = None) -> Request:
        return Request(rid, "", sampling(), openai_body=chat, resume=resume)

    reference = answer(server.url, server, row("ref"))
    proxy, url = stalled(server, 1)
    cut = engine_at(url, server, tokenizer_dir)
    try:
        cut.add_request(row("cut"))
        # the chat's first event names the role and has no text: CUT - 1 pieces
        wait_until(
            lambda: cut.step() == [] and cut.progress().get("cut") == CUT - 1, 60, "the stream stalled"
        )
        taken = cut.suspend("cut")
    finally:
        cut.close()
        proxy.stop()
    assert len(taken) == CUT - 1 and reference.text.startswith(taken.text)
    resumed = answer(server.url, server, row("res", taken), tokenizer_dir)
    assert (resumed.text, resumed.completion_tokens, resumed.prompt_tokens, resumed.finish_reason) == (
        reference.text,
        reference.completion_tokens,
        reference.prompt_tokens,
        reference.finish_reason,
    )


def test_a_stream_cut_short_goes_on_from_its_text(server):
    """The server goes away mid-answer (the proxy closes the connection after :data:`CUT` events): the request is
    sent again for the rest only, and the answer is the uninterrupted one."""
    reference = answer(server.url, server, Request("ref", PROMPT, sampling()))
    proxy, url = stalled(server, 1, "cut")
    engine = engine_at(url, server)
    try:
        out = run_to_end(engine, Request("cut", PROMPT, sampling()))
        generated = engine.stats().generated_tokens
    finally:
        engine.close()
        proxy.stop()
    assert proxy.counts() == {f"cut-{CUT}": 1, "pass": 1}
    assert (out.text, out.completion_tokens, out.prompt_tokens, out.finish_reason) == (
        reference.text,
        reference.completion_tokens,
        reference.prompt_tokens,
        reference.finish_reason,
    )
    assert generated == reference.completion_tokens - CUT  # the first pieces were not generated again


def test_a_partial_output_that_took_every_token_ends_at_once(server):
    engine = engine_at(server.url, server)
    try:
        out = run_to_end(
            engine, Request("x", PROMPT, SamplingParams(max_tokens=4), resume=Partial((), "abcd", 4))
        )
    finally:
        engine.close()
    assert (out.text, out.completion_tokens, out.finish_reason) == ("abcd", 4, "length")


def endpoint_worker(queue: WorkQueue, cluster: str, url: str, server, **config) -> Worker:
    c = WorkerConfig(cluster=cluster, backend="endpoint", record_observed=False, cancel_check_s=0.0, **config)
    return Worker(queue, engine_at(url, server), c)


def queries(n: int, batch: str) -> list[QueuedQuery]:
    return [
        QueuedQuery(batch, f"q{i}", f"{PROMPT} ({i})", MAX_TOKENS, 12, float(MAX_TOKENS)) for i in range(n)
    ]


def saved(queue: WorkQueue, gid: str) -> Partial | None:
    return Partial.decode(queue.r.hget(keys.query(gid), keys.PARTIAL))


def results(queue: WorkQueue, batch: str) -> dict[str, QueryResult]:
    return {r.query_id: r for r in map(QueryResult.from_json, queue.r.lrange(keys.results(batch), 0, -1))}


def resumed(
    queue: WorkQueue, cluster: str, server, batch: str, qs: list[QueuedQuery], partials: dict
) -> None:
    """A worker of ``cluster`` (straight to the server) answers ``qs``, each continuing its partial output: once
    each, the whole answer, counted once."""
    worker = endpoint_worker(queue, cluster, server.url, server)
    try:
        assert worker.run(max_queries=len(qs)) == len(qs)
    finally:
        worker.engine.close()
    counted = {m.name: m.samples[0].value for m in WorkerCollector(worker).collect()}
    assert counted["fleetbatch_worker_resumed_queries"] == worker.resumed_queries == len(qs)
    assert counted["fleetbatch_worker_resumed_tokens"] == sum(len(partials[q.gid]) for q in qs)
    rows = results(queue, batch)
    assert sorted(rows) == sorted(q.query_id for q in qs)
    for q in qs:
        row, p, whole = rows[q.query_id], partials[q.gid], served(server, q.prompt, MAX_TOKENS)
        assert row.text.startswith(p.text) and not row.error, row
        assert (row.text, row.completion_tokens, row.prompt_tokens) == (
            whole["text"],
            whole["completion_tokens"],
            whole["prompt_tokens"],
        )  # the uninterrupted answer, counted once
    assert check(queue.r) == []


def test_a_notice_checkpoints_the_streams_text_and_another_cluster_continues_it(redis_url, server):
    queue = WorkQueue(connect(redis_url))
    qs = queries(3, "n1")
    queue.register_cluster("b", capacity_hint_tps=100.0)
    assert queue.create_batch("n1", [(q, "a") for q in qs])
    proxy, url = stalled(server, len(qs))
    worker = endpoint_worker(queue, "a", url, server, checkpoint_tokens=8)
    thread = threading.Thread(target=worker.run, daemon=True)
    try:
        thread.start()
        wait_until(lambda: worker.engine.progress() == {q.gid: CUT for q in qs}, 60, "every stream stalled")
        streamed = {q.gid: worker.engine.partial(q.gid) for q in qs}
        assert queue.give_notice("a", 0) <= 0
        thread.join(timeout=60)
        assert not thread.is_alive()
    finally:
        worker.stop()
        worker.engine.close()
        proxy.stop()
    for q in qs:
        h = queue.r.hgetall(keys.query(q.gid))
        assert h["state"] == "queued" and int(h.get("attempts", 0)) == 0  # the preemption used no attempt
        assert saved(queue, q.gid) == streamed[q.gid] and len(streamed[q.gid]) == CUT
    Offloader(queue).tick()  # the preempted cluster's queue goes to b
    assert queue.r.zcard(keys.queue("b")) == len(qs)
    resumed(queue, "b", server, "n1", qs, streamed)
    assert all(r.attempts == 1 for r in results(queue, "n1").values())


def test_a_killed_endpoint_engine_loses_no_streamed_text_past_its_checkpoints(redis_url, server, tmp_path):
    """A real engine process whose streams stall after :data:`CUT` events, SIGKILLed by pid once Redis holds
    their checkpoints: each query continues elsewhere from the text checkpointed."""
    queue = WorkQueue(connect(redis_url))
    qs = queries(2, "k1")
    assert queue.create_batch("k1", [(q, "k") for q in qs])
    proxy, url = stalled(server, len(qs))
    proc = start_engine(
        "k", redis_url, tmp_path, "--backend", "endpoint", "--endpoint-url", url,
        "--served-model-name", server.model, "--checkpoint-tokens", "2", "--heartbeat-s", "0.3",
        "--endpoint-timeout-s", "300",  # the stalled streams are not given up on before the kill
    )  # fmt: skip
    try:
        kill_when(proc, lambda: all(len(saved(queue, q.gid) or ()) == CUT for q in qs), "the checkpoints")
    finally:
        proxy.stop()
    partials = {q.gid: saved(queue, q.gid) for q in qs}
    assert all(p.text and not p.token_ids for p in partials.values())
    assert not queue.r.lrange(keys.results("k1"), 0, -1)
    queue.r.zadd(keys.inflight("k"), {q.gid: 0 for q in qs}, xx=True)  # their leases lapse, as after a kill
    assert queue.requeue_expired("k") == 2
    resumed(queue, "k", server, "k1", qs, partials)  # the engine started again, without the stalling proxy
    assert all(r.attempts == 2 for r in results(queue, "k1").values())
