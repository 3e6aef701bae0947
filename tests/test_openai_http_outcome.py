"""Issue 31, finding 3, as the user sees it: an OpenAI batch through the HTTP front whose one row
the engine's KV cache cannot hold. Real Redis, the real gateway and a real worker (in this
process, its engine's KV cache made tiny): the row is in the error file exactly once, with a clear
error, the others in the output file, and ``request_counts`` match the files' lines."""

from __future__ import annotations

import json
import threading

from openai import OpenAI

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.worker import Worker, WorkerConfig
from gateway.http_api.format import COMPLETIONS
from localmodels import build_model, default_tokenizer
from tests.harness import wait_until
from tests.openai_http_helpers import KEY, check_output_line, http_gateway, jsonl, wait_final
from workqueue import WorkQueue, connect, keys


def test_a_row_the_kv_cache_cannot_hold_is_in_the_error_file_once(redis_url, tmp_path):
    gateway = http_gateway(redis_url, tmp_path / "files", cluster="tiny")
    gateway.start()
    tok = default_tokenizer()
    engine = LLMEngine(
        build_model("llama", "nano", tokenizer=tok, seed=3),
        tok,
        EngineConfig(kv_budget_tokens=32, block_size=4, max_running=1),
    )
    worker = Worker(WorkQueue(connect(redis_url)), engine, WorkerConfig(cluster="tiny", backend="native"))
    serving = threading.Thread(target=worker.run, daemon=True)
    try:
        client = OpenAI(base_url=gateway.config.http_url, api_key=KEY, max_retries=0)
        rows = [
            {"custom_id": "long", "url": COMPLETIONS, "body": {"prompt": "rivers", "max_tokens": 60}},
            {"custom_id": "short", "url": COMPLETIONS, "body": {"prompt": "lakes", "max_tokens": 4}},
        ]
        f = client.files.create(file=("kv.jsonl", jsonl(rows)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
        # the engine starts once the batch is queued: its heartbeat's KV size would make the gateway
        # refuse the long row at submit, and the row must reach the engine
        wait_until(lambda: client.batches.retrieve(batch.id).status != "validating", 60, "the batch queued")
        serving.start()
        done = wait_final(client, batch.id, 180)
        assert done.status == "completed", done
        out, err = (
            [json.loads(x) for x in client.files.content(fid).text.splitlines()] if fid else []
            for fid in (done.output_file_id, done.error_file_id)
        )
    finally:
        worker.stop()
        if serving.is_alive():
            serving.join(timeout=30)
        gateway.stop()
    for line in out + err:
        check_output_line(line, COMPLETIONS, {"long", "short"})
    assert [x["custom_id"] for x in out] == ["short"] and [x["custom_id"] for x in err] == ["long"]
    assert "KV cache" in err[0]["error"]["message"]
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (2, len(out), len(err))
    assert done.usage.output_tokens == out[0]["response"]["body"]["usage"]["completion_tokens"]
    assert worker.queue.r.llen(keys.OBSERVED) == 1  # the short answer; the failed row is no observation
