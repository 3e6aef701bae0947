"""What the tests of the OpenAI-compatible HTTP front share: a gateway with the front, the
engine's side done through the queue API, raw HTTP calls, and OpenAI's output line shape."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from openai import OpenAI

from gateway.config import ClusterSpec, GatewayConfig
from gateway.http_api.format import CHAT
from tests.harness import GatewayThread
from workqueue import WorkQueue

KEY = "test-key-123"
ENGINE_ARGS = ("--backend", "static", "--size", "nano", "--max-running", "8", "--heartbeat-s", "0.3")
FINAL = ("completed", "failed", "cancelled", "expired")


def check_output_line(line: dict, endpoint: str, custom_ids: set[str]) -> None:
    """One line of an OpenAI batch output or error file, as OpenAI writes it."""
    assert set(line) == {"id", "custom_id", "response", "error"}, line
    assert isinstance(line["id"], str) and line["id"].startswith("batch_req_")
    assert line["custom_id"] in custom_ids
    if line["error"] is not None:
        assert line["response"] is None
        assert isinstance(line["error"]["code"], str) and isinstance(line["error"]["message"], str)
        return
    resp = line["response"]
    assert resp["status_code"] == 200 and isinstance(resp["request_id"], str) and resp["request_id"]
    body = resp["body"]
    chat = endpoint == CHAT
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert isinstance(body["id"], str) and isinstance(body["created"], int) and isinstance(body["model"], str)
    assert len(body["choices"]) == 1
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    if chat:
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    else:
        assert isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] >= 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def wait_final(client: OpenAI, batch_id: str, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in FINAL:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status}"
        time.sleep(0.2)


def http_gateway(redis_url: str, files_dir, cluster: str = "a", **kw) -> GatewayThread:
    """A gateway with its HTTP front; chat rows take the documented template unless ``tokenizer_dir``
    names a served model (the engines of these tests run the project's own random models)."""
    kw.setdefault("chat_template", "" if kw.get("tokenizer_dir") else "default")
    config = GatewayConfig(
        redis_url=redis_url,
        offload=False,
        clusters=[ClusterSpec(cluster, capacity_tps=100)],
        http_port=0,
        http_api_key=KEY,
        files_dir=str(files_dir),
        **kw,
    )
    return GatewayThread(config)


def raw_call(
    url: str, key: str | None = KEY, data: bytes | None = None, timeout: float = 10
) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete_claimed(queue: WorkQueue, cluster: str, n: int, text: str = "ok", tokens: int = 1) -> int:
    """The engine's side, through the queue API: claim up to ``n`` queries of ``cluster`` and
    complete each with ``text``; returns how many."""
    claimed = queue.claim(cluster, n, "w", 30)
    for c in claimed:
        result = {"batch_id": c.query.batch_id, "query_id": c.query.query_id, "text": text,
                  "prompt_tokens": 3, "completion_tokens": tokens, "finish_reason": "stop"}  # fmt: skip
        queue.complete(c.query.gid, result, "completed", tokens)
    return len(claimed)
