"""The endpoint backend against a real ``transformers serve`` (one per module, tests/endpoint_server.py):
real ``fleetbatch engine serve --backend endpoint`` processes fed through the real Redis queue, the
server killed by its pid mid-batch and started again, a real fault proxy answering 503 or hanging in
front of it; every row comes back exactly once, none failed, with the server's usage."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections import Counter
from collections.abc import Mapping

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from engines.endpoint_backend import EndpointEngine
from engines.endpoint_flow import FlowSettings
from engines.endpoint_settings import EndpointSettings
from engines.interface import EngineFailure, Request, SamplingParams
from gateway.deploy.forked import EngineProcess
from gateway.http_api.format import CHAT, DEFAULT_TEMPLATE, render_chat
from gateway.server import token_counter
from tests.endpoint_server import chat_model_dir, endpoint_server, free_port
from tests.fault_proxy import FaultProxy
from tests.harness import REPO, start_engine, wait_until
from tests.openai_http_helpers import KEY, http_gateway, jsonl, wait_final
from workqueue import QueuedQuery, WorkQueue, connect

# one worker runs the module, so one transformers serve starts (each costs a model load)
pytestmark = [pytest.mark.fault, pytest.mark.xdist_group("endpoint-server")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with endpoint_server(model_dir, tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


def _queries(batch: str, n: int, max_tokens: int) -> list[QueuedQuery]:
    return [
        QueuedQuery(batch, f"q{i}", f"Tell me about the river number {i}.", max_tokens, 10, float(max_tokens))
        for i in range(n)
    ]


def _engine(cluster: str, redis_url: str, log_dir, *extra: str) -> EngineProcess:
    return start_engine(
        cluster,
        redis_url,
        log_dir,
        "--backend",
        "endpoint",
        "--heartbeat-s",
        "0.3",
        "--max-running",
        "4",
        *extra,
    )


def _stop(engine: EngineProcess) -> None:
    if engine.poll() is None:
        os.kill(engine.pid, signal.SIGTERM)
    try:
        engine.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait()


def _each_once_none_failed(queue: WorkQueue, batch: str, queries: list[QueuedQuery]) -> list[dict]:
    results = queue.results(batch)
    counts = Counter(r["query_id"] for r in results)
    assert sorted(counts) == sorted(q.query_id for q in queries) and set(counts.values()) == {1}
    for r in results:
        assert not r.get("error") and r["finish_reason"] in ("stop", "length"), r
        assert r["completion_tokens"] >= 1 and r["prompt_tokens"] >= 1, r
    return results


def test_a_chat_completion_counts_the_prompt_as_the_saved_chat_template_renders_it(server, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith(tokenizer.bos_token) and rendered.endswith("<|im_start|>assistant\n")
    assert DEFAULT_TEMPLATE.format(role="user", content="Name a river.") not in rendered
    ids = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert (
        ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    )
    body = {"model": server.model, "messages": messages, "max_tokens": 4, "temperature": 0}
    reply = httpx.post(server.url + "/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert 1 <= usage["completion_tokens"] <= 4


def test_the_gateway_counts_a_chat_as_the_server_does_one_start_token(tokenizer):
    """A template that writes the BOS itself: the gateway's count is the server's, not one more (it was)."""
    messages = [{"role": "user", "content": "Name a river."}]
    ids = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert token_counter(tokenizer)([render_chat(messages, tokenizer), "plain text"]) == [
        len(ids),
        len(_ids(tokenizer("plain text"))),
    ]


def test_chat_rows_go_to_the_server_as_messages_counted_as_it_counts_them(
    server, tokenizer, model_dir, redis_url, tmp_path
):
    """An OpenAI batch of chat rows through the gateway (counting in the served model's tokenizer) and a
    real engine process: each row reaches /v1/chat/completions with its own messages, and for every row
    the prompt tokens the gateway counted equal the server's usage.prompt_tokens."""
    gateway = http_gateway(redis_url, tmp_path / "files", cluster="ep", tokenizer_dir=str(model_dir))
    gateway.start()
    # the base URL without /v1 (added), the model's name asked from /v1/models
    engine = _engine("ep", redis_url, tmp_path, "--endpoint-url", server.url.removesuffix("/v1"))
    try:
        client = OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0)
        chats = {
            f"c{i}": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Name river {i}."},
            ]
            for i in range(8)
        }
        rows = [
            {"custom_id": c, "body": {"model": server.model, "messages": m, "max_tokens": 8}}
            for c, m in chats.items()
        ]
        f = client.files.create(file=("chat.jsonl", jsonl(rows)), purpose="batch")
        batch = wait_final(
            client, client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h").id, 240
        )
        assert batch.status == "completed" and batch.request_counts.completed == len(rows), batch
        lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        info = wait_until(
            lambda: [i for i in WorkQueue(connect(redis_url)).clusters(["ep"]) if i.measured_tps > 0],
            30,
            "a rate",
        )
        assert info[0].backend == "endpoint" and info[0].openai_fields
    finally:
        _stop(engine)
        gateway.stop()
    assert engine.returncode == 0
    count = token_counter(tokenizer)
    mismatches = []
    for line in lines:
        usage = line["response"]["body"]["usage"]
        counted = count([render_chat(chats[line["custom_id"]], tokenizer)])[0]
        served = len(
            _ids(
                tokenizer.apply_chat_template(
                    chats[line["custom_id"]], add_generation_prompt=True, tokenize=True
                )
            )
        )
        if not usage["prompt_tokens"] == counted == served:
            mismatches.append((line["custom_id"], usage["prompt_tokens"], counted, served))
        assert 1 <= usage["completion_tokens"] <= 8
    assert sorted(x["custom_id"] for x in lines) == sorted(chats) and mismatches == []
    assert f"serves {server.model}" in (tmp_path / "engine-ep.log").read_text()


def test_a_server_killed_mid_batch_and_started_again_fails_no_row(server, redis_url, tmp_path):
    queue = WorkQueue(connect(redis_url))
    queries = _queries("b2", 12, 24)
    assert queue.create_batch("b2", [(q, "ep2") for q in queries])
    engine = _engine("ep2", redis_url, tmp_path, "--endpoint-url", server.url)
    try:
        wait_until(lambda: queue.result_count("b2") >= 1, 240, "a first result")
        server.kill()
        done_at_kill = queue.result_count("b2")
        server.start()  # the same port; the engine backs off meanwhile
        wait_until(lambda: queue.result_count("b2") >= len(queries), 240, "every result")
    finally:
        _stop(engine)
    _each_once_none_failed(queue, "b2", queries)
    if done_at_kill < len(queries):  # the engine saw the server gone (it almost always does)
        assert "it is not failed" in (tmp_path / "engine-ep2.log").read_text()


def test_503s_and_hangs_are_backed_off_and_fail_no_row(server, redis_url, tmp_path):
    proxy = FaultProxy(server.port, ["503"] * 3 + ["hang"] * 2)
    port = proxy.start()
    queue = WorkQueue(connect(redis_url))
    queries = _queries("b3", 6, 8)
    assert queue.create_batch("b3", [(q, "ep3") for q in queries])
    key = tmp_path / "endpoint-key"
    key.write_text("sk-test-key\n")
    engine = _engine(
        "ep3", redis_url, tmp_path, "--endpoint-url", f"http://127.0.0.1:{port}/v1",
        "--served-model-name", server.model, "--endpoint-timeout-s", "2", "--endpoint-key-file", str(key),
    )  # fmt: skip
    try:
        wait_until(lambda: queue.result_count("b3") >= len(queries), 240, "every result")
    finally:
        _stop(engine)
        proxy.stop()
    _each_once_none_failed(queue, "b3", queries)
    seen = proxy.counts()
    assert seen["503"] == 3 and seen["hang"] == 2 and seen["pass"] >= 1
    assert len(proxy.heads) == 5 and all(b"Bearer sk-test-key\r\n" in head for head in proxy.heads)
    log = (tmp_path / "engine-ep3.log").read_text()
    assert "HTTP 503" in log and "ReadTimeout" in log


def test_two_endpoints_share_the_requests(server, tokenizer):
    proxy = FaultProxy(server.port, [])  # a second address of the same server: it only relays
    port = proxy.start()
    urls = (server.url, f"http://127.0.0.1:{port}/v1")
    engine = EndpointEngine(EndpointSettings(urls=urls, model=server.model))
    try:
        prompts = {f"r{i}": f"Tell me about the city number {i}." for i in range(4)}
        for i, (rid, prompt) in enumerate(prompts.items()):
            engine.add_request(Request(rid, prompt, SamplingParams(max_tokens=4, seed=i)))
        outs = []
        wait_until(lambda: outs.extend(engine.step()) or len(outs) == len(prompts), 120, "every output")
        assert sorted(o.request_id for o in outs) == sorted(prompts)
        for o in outs:
            assert o.finish_reason in ("stop", "length") and 1 <= o.completion_tokens <= 4 and not o.error
            assert o.prompt_tokens == len(_ids(tokenizer(prompts[o.request_id])))
        assert (
            proxy.counts()["pass"] >= 1
        )  # the second endpoint took some (two at once each, the least loaded)
        assert engine.stats().generated_tokens == sum(o.completion_tokens for o in outs)
    finally:
        engine.close()
        proxy.stop()


@pytest.mark.parametrize(
    ("faults", "outcome", "logged"),
    [
        (["422"], "answered", "asking it without stream_options"),  # a strict server: asked again without
        (["500", "500"], "answered", "HTTP 500"),  # a server error: tried again (three tries in all)
        (["500", "500", "500"], "HTTP 500: fault proxy: 500", ""),  # the third: the row fails, saying why
        (["400"], "HTTP 400: fault proxy: 400", ""),  # a refusal: the row fails at once with its message
        (["cut"], "answered", "the stream ended before the completion did"),  # sent again
        (["no-usage"], "no usage", "sends no usage"),  # counted from the stream: 2 pieces, prompt 0
    ],
)
def test_refusals_and_server_errors(server, faults, outcome, logged, caplog):
    proxy = FaultProxy(server.port, faults)
    port = proxy.start()
    engine = EndpointEngine(EndpointSettings(urls=(f"http://127.0.0.1:{port}/v1",), model=server.model))
    try:
        engine.add_request(Request("r1", "Tell me about rivers.", SamplingParams(max_tokens=4)))
        (out,) = wait_until(engine.step, 120, "the output")
    finally:
        engine.close()
        proxy.stop()
    if outcome == "answered":
        assert out.finish_reason in ("stop", "length") and out.completion_tokens >= 1 and not out.error
    elif outcome == "no usage":
        assert (out.text, out.finish_reason, out.completion_tokens, out.prompt_tokens) == (
            "Hi there",
            "stop",
            2,
            0,
        )
    else:
        assert out.finish_reason == "error" and outcome in out.error and out.completion_tokens == 0
    assert logged in caplog.text
    assert sum(proxy.counts()[f] for f in set(faults)) == len(faults)


def test_an_aborted_request_closes_its_stream_and_answers_abort(server):
    proxy = FaultProxy(server.port, ["hang"])
    port = proxy.start()
    engine = EndpointEngine(EndpointSettings(urls=(f"http://127.0.0.1:{port}/v1",), model=server.model))
    try:
        engine.add_request(Request("r1", "Tell me about rivers.", SamplingParams(max_tokens=4)))
        wait_until(
            lambda: proxy.counts()["hang"] == 1 and engine.stats().running == 1, 60, "the request sent"
        )
        engine.abort_request("r1")
        outs = wait_until(engine.step, 60, "the abort")
        assert [(o.request_id, o.finish_reason) for o in outs] == [("r1", "abort")]
        assert not engine.has_unfinished() and engine.free_slots() == int(FlowSettings.initial_limit)
    finally:
        engine.close()
        proxy.stop()


def test_no_endpoint_answering_for_the_give_up_time_fails_the_engine_and_keeps_the_rows():
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    engine = EndpointEngine(EndpointSettings(urls=(url,), model="m", give_up_s=1.0))
    try:
        engine.add_request(Request("r1", "Tell me about rivers.", SamplingParams(max_tokens=4)))
        with pytest.raises(EngineFailure, match=r"no endpoint answered for 1 s \(last: http://127\.0\.0\.1"):
            wait_until(engine.step, 60, "the failure")
        assert engine.has_unfinished() and engine.free_slots() == 0  # the worker gives it back to the queue
        engine.add_request(Request("r2", "more", SamplingParams(max_tokens=4)))  # held, not sent, not failed
        with pytest.raises(EngineFailure):
            engine.step()
    finally:
        engine.close()


HOW_TO = REPO / "docs" / "how-to" / "own-gpus.md"


def test_every_command_of_the_how_to_runs_against_transformers_serve(server, model_dir, tmp_path):
    """docs/how-to/own-gpus.md, run as written: its bash blocks in order in one shell, with this machine's
    server for both clouds (the second through a relay: another address), its model for the names, a free
    port for 50051; the batch comes back whole, each cloud's engine served, and everything stops."""
    blocks = re.findall(r"```bash\n(.*?)```", HOW_TO.read_text(), re.S)
    assert blocks[0].startswith("# on each GPU machine") and "vllm serve" in blocks[0]  # the servers: ours
    assert blocks[1].startswith("export GPU_A=")  # the names of your servers and model: this machine's
    relay = FaultProxy(server.port, [])
    relay_port = relay.start()
    names = (
        f"export GPU_A={server.url.removesuffix('/v1')} GPU_B=http://127.0.0.1:{relay_port}"
        f" MODEL_NAME={server.model} MODEL_DIR={model_dir}\n"
    )
    script = "\n".join([names, *blocks[2:]]).replace("50051", str(free_port()))
    (tmp_path / "endpoint-key").write_text("sk-how-to\n")
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    finally:
        relay.stop()
        info = tmp_path / "runs" / "gpus" / "gateway.json"
        if info.exists():  # the script stopped before its last block
            os.kill(json.loads(info.read_text())["pid"], signal.SIGINT)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("runs/gpus/logs/*.log")))
    up = (tmp_path / "gateway-up.log").read_text() if (tmp_path / "gateway-up.log").exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + up + logs
    out = done.stdout
    assert out.count(" answers\n") == 2 and "completed" in out and out.count("serving cluster") == 2, out
    assert "cloud-a" in out and "cloud-b" in out  # gateway status
    assert "rendered with the chat template of" in logs  # cloud-b's engine read --endpoint-tokenizer
    lines = [json.loads(x) for x in (tmp_path / "batch_output.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == ["q1", "q2", "q3"]
    assert all(x["response"]["body"]["usage"]["prompt_tokens"] > 0 for x in lines)
    wait_until(lambda: not info.exists(), 60, "gateway up to stop")  # it removes its gateway.json last
