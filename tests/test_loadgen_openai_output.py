"""`fleetbatch loadgen submit --jsonl IN --openai-out OUT`: OpenAI Batch output (chat.completion /
text_completion bodies with usage) for the requests that succeeded, OpenAI-shaped errors for the
rest; real gateway, real Redis (the engine's work done through the queue API)."""

from __future__ import annotations

import json
import threading

import pytest

from gateway.config import ClusterSpec, GatewayConfig
from gateway.http_api.format import render_chat
from load.cli import main
from load.openai_batch import error_path
from load.workload import from_openai_jsonl
from localmodels import default_tokenizer
from tests.harness import GatewayThread, wait_until
from workqueue import WorkQueue, connect


def test_openai_batch_output_and_errors(redis_url, tmp_path):
    g = GatewayThread(GatewayConfig(redis_url=redis_url, offload=False, clusters=[ClusterSpec("a")]))
    address = g.start()
    queue = WorkQueue(connect(redis_url))
    rows = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5}},
        {"custom_id": "text-1", "method": "POST", "url": "/v1/completions", "body": {"model": "m2", "prompt": "Once"}},
        {"custom_id": "chat-2", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Hi"}]}},
    ]  # fmt: skip
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "batch_output.jsonl"
    code: list[int] = []
    argv = [
        "submit",
        "--target",
        address,
        "--jsonl",
        str(src),
        "--openai-out",
        str(out),
        "--no-progress",
        "--chat-template",  # no served model here: the project's own template, asked for by name
        "default",
    ]
    t = threading.Thread(target=lambda: code.append(main(argv)))
    try:
        t.start()
        wait_until(lambda: queue.clusters(["a"])[0].queue_length == 3, 30, "three rows queued")
        for c in queue.claim("a", 3, "w", 30):
            q = c.query
            result = {"batch_id": q.batch_id, "query_id": q.query_id, "text": "hi!", "prompt_tokens": 4,
                      "completion_tokens": 2, "finish_reason": "length"}  # fmt: skip
            if q.query_id == "chat-2":
                result.update(finish_reason="error", error="the engine failed")
            queue.complete(q.gid, result, "failed" if q.query_id == "chat-2" else "completed", 2)
        t.join(timeout=60)
    finally:
        g.stop()
    lines = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(lines) == {"chat-1", "text-1"}
    chat = lines["chat-1"]["response"]
    assert chat["status_code"] == 200 and lines["chat-1"]["error"] is None
    assert chat["body"]["object"] == "chat.completion" and chat["body"]["model"] == "m"
    assert chat["body"]["choices"][0]["message"] == {"role": "assistant", "content": "hi!"}
    assert chat["body"]["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert lines["text-1"]["response"]["body"]["choices"][0]["text"] == "hi!"
    assert lines["text-1"]["response"]["body"]["object"] == "text_completion"
    assert lines["text-1"]["response"]["body"]["model"] == "m2"  # each line the model its request named
    errors = [json.loads(x) for x in error_path(out).read_text().splitlines()]
    assert [(e["custom_id"], e["response"], e["error"]["message"]) for e in errors] == [
        ("chat-2", None, "the engine failed")
    ]
    assert len({r["id"] for r in [*lines.values(), *errors]}) == 3


def test_an_unsupported_endpoint_is_named(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "x"}}) + "\n")
    assert main(["submit", "--target", "127.0.0.1:1", "--jsonl", str(src), "--no-progress"]) == 1
    assert "/v1/embeddings" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--openai-out", "x.jsonl"]])
def test_openai_out_needs_an_openai_input(flags, capsys):
    assert main(["submit", "--target", "127.0.0.1:1", "--no-progress", *flags]) == 1
    assert "--openai-out needs --jsonl" in capsys.readouterr().err


def test_chat_messages_use_the_tokenizers_template_or_the_documented_default():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    assert render_chat(msgs) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    tok = default_tokenizer()
    tok.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    assert render_chat(msgs, tok) == "[system] Be brief.\n[user] Hi\n[assistant]"


@pytest.mark.parametrize(
    "body, named",
    [
        ({"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
        ({"prompt": "x", "n": 2}, "n=2"),
        ({"prompt": "x", "stream": True}, "stream"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url"),
    ],
)
def test_what_cannot_be_honoured_is_named(tmp_path, body, named):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "c", "url": "/v1/chat/completions", "body": body}) + "\n")
    with pytest.raises(ValueError, match=named):
        from_openai_jsonl(src)
