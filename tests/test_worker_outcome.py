"""Issue 31, finding 3: one function decides a result's outcome. A query the KV cache cannot hold
fails with a clear error (it is no answer, and no observation of a response length), while an
answer cut at its token limit is a truncated, completed answer."""

from __future__ import annotations

import pytest

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.worker import Worker, WorkerConfig
from localmodels import build_model, default_tokenizer
from workqueue import Outcome, QueryResult, QueryState, QueuedQuery, WorkQueue, connect, keys, outcome


@pytest.mark.parametrize(
    ("reason", "error", "expected", "state"),
    [
        ("stop", None, Outcome.COMPLETED, QueryState.COMPLETED),
        ("length", "", Outcome.TRUNCATED, QueryState.COMPLETED),
        ("length", "KV cache too small for this query", Outcome.FAILED, QueryState.FAILED),
        ("error", "invalid query: empty prompt", Outcome.FAILED, QueryState.FAILED),
        ("abort", None, Outcome.CANCELLED, QueryState.CANCELLED),
        ("cancelled", None, Outcome.CANCELLED, QueryState.CANCELLED),
    ],
)
def test_one_function_decides_the_outcome(reason, error, expected, state):
    assert outcome(reason, error) is expected and expected.state is state
    assert QueryResult("b", "q", finish_reason=reason, error=error).outcome is expected
    assert expected.answered == (state is QueryState.COMPLETED)


def test_a_query_the_kv_cache_cannot_hold_fails_and_is_no_observation(redis_url):
    queue = WorkQueue(connect(redis_url))
    # real answers, not forced lengths: each is an observation when answered
    big = QueuedQuery("b1", "big", "a question about rivers", 60, 6, 10.0)  # outgrows the 32-token cache
    small = QueuedQuery("b1", "small", "a question about lakes", 8, 6, 4.0)
    assert queue.create_batch("b1", [(big, "w"), (small, "w")])
    tok = default_tokenizer()
    model = build_model("llama", "nano", tokenizer=tok, seed=3)
    engine = LLMEngine(model, tok, EngineConfig(kv_budget_tokens=32, block_size=4, max_running=1))
    worker = Worker(queue, engine, WorkerConfig(cluster="w", backend="native"))
    assert worker.run(max_queries=2) == 2
    results = {r["query_id"]: r for r in queue.results("b1")}
    failed = results["big"]
    assert failed["finish_reason"] == "error" and "KV cache" in failed["error"], failed
    assert outcome(results["small"]["finish_reason"], results["small"].get("error")).answered
    info = queue.batch("b1")
    assert (info.completed, info.failed) == (1, 1)
    observed = [o for o in queue.r.lrange(keys.OBSERVED, 0, -1)]
    assert len(observed) == 1 and "lakes" in observed[0]
