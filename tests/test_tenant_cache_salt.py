"""Tenants apart in the prefix cache (issue 48, finding 7 and Build 3): a per-tenant salt starts the hash
chain of the engine's prefix-cache block keys, so one tenant's prompt never hits another's cached KV (time to
first token would tell it whether the other's prefix is cached). The gateway turns a batch's owner into the
salt (a short hash: the engine never sees the client's name), the queued payload carries it (``cache_salt``),
the worker hands it to the engine; ``--shared-prefix-cache`` turns it off.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from cliutil.config_file import resolve_config
from engines.checkpoints import Checkpoints
from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.kv_cache import KVCacheManager
from engines.sequence import Sequence
from engines.vllm_engine import takes_cache_salt, vllm_prompt
from engines.worker import Worker
from gateway.batches.quota import OWNER_FIELD
from gateway.cli import build_parser
from gateway.config import ClusterSpec, GatewayConfig
from gateway.grpc_api.tls import channel
from gateway.intake.rows import BATCH_OWNER_FIELD, tenant_salt
from localmodels import build_model, default_tokenizer, generated_corpus
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, batch_of, wait_until
from workqueue import ClaimedQuery, QueuedQuery, WorkQueue, connect, keys

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
TOKENS = {ALICE: "alice", BOB: "bob"}
PROMPT = (
    "You answer questions about rivers, cities and the weather in short plain sentences, "
    "and you always say which city you mean before you answer anything at all. Which river?"
)


# ---- the engine's KV cache -------------------------------------------------------------------------
def _committed(kv: KVCacheManager, seq: Sequence) -> None:
    assert kv.admit(seq, kv.lookup(seq), seq.num_tokens)
    seq.num_computed = seq.num_tokens
    kv.commit(seq)


def test_two_tenants_with_the_same_prompt_share_no_cached_block_and_one_tenant_does():
    kv = KVCacheManager(num_blocks=16, block_size=4, prefix_cache=True)
    tokens = list(range(13))  # three full blocks and one token
    _committed(kv, Sequence("a1", tokens, cache_salt="tenant-a"))
    assert kv.lookup(Sequence("b1", tokens, cache_salt="tenant-b")) == []
    assert kv.lookup(Sequence("u1", tokens)) == []  # nor does a query without a salt
    assert len(kv.lookup(Sequence("a2", tokens, cache_salt="tenant-a"))) == 3
    _committed(kv, Sequence("u2", tokens))
    assert kv.num_cached_blocks == 6  # each tenant's blocks under keys of its own
    assert len(kv.lookup(Sequence("u3", tokens))) == 3  # no salt: one shared cache, as before


def test_the_native_engine_hits_its_prefix_cache_only_within_a_tenant():
    tokenizer = default_tokenizer(vocab_size=1024, texts=generated_corpus(400))
    model = build_model("llama", "nano", tokenizer=tokenizer, seed=4)
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(
            prefix_cache=True, kv_budget_tokens=1024, block_size=4, max_batch_tokens=256, max_running=4
        ),
    )

    def hits(rid: str, salt: str) -> int:
        before = engine.stats().prefix_hit_tokens
        engine.add_request(
            Request(rid, PROMPT, SamplingParams(max_tokens=4, forced_length=2), cache_salt=salt)
        )
        while engine.has_unfinished():
            engine.step()
        return engine.stats().prefix_hit_tokens - before

    assert hits("a1", "tenant-a") == 0
    assert hits("b1", "tenant-b") == 0  # the same prompt, another tenant: computed again
    assert hits("a2", "tenant-a") > 0  # the same tenant: its prefix is cached


def test_the_worker_hands_the_queued_salt_to_the_engine():
    got: list[Request] = []
    q = QueuedQuery("b", "q0", "hello", 8, 1, 4.0, cache_salt="5a1f00d")
    stub = SimpleNamespace(
        agent=SimpleNamespace(aborts=lambda: [], take=lambda n: [ClaimedQuery(q, 0, 0.0, 1.0)], free_slots=0),
        engine=SimpleNamespace(add_request=got.append, free_slots=lambda: 4),
        config=SimpleNamespace(openai_fields=(), backend="native"),
        resumable=True,
        checkpoints=Checkpoints(0),
    )
    Worker.start_claimed(stub)  # type: ignore[arg-type]
    assert [r.cache_salt for r in got] == ["5a1f00d"]


def test_the_vllm_backend_passes_the_salt_as_vllms_cache_salt():
    salted = Request("r", "hello", cache_salt="5a1f00d")
    assert vllm_prompt(salted) == {"prompt": "hello", "cache_salt": "5a1f00d"}
    assert vllm_prompt(Request("r", "hello")) == "hello"  # no salt: the prompt as before
    assert vllm_prompt(salted, salts=False) == "hello"  # a vLLM without cache_salt
    assert [takes_cache_salt(v) for v in ("0.8.5", "0.9.0rc1", "0.11.1", "1.0")] == [False, True, True, True]


# ---- the gateway: the salt of a batch's owner in every payload --------------------------------------
def test_a_salt_is_a_short_hash_of_the_owner_and_none_without_one():
    assert BATCH_OWNER_FIELD == OWNER_FIELD
    a = tenant_salt("alice")
    assert a and "alice" not in a and len(a) <= 32
    assert tenant_salt("alice") == a != tenant_salt("bob")
    assert tenant_salt(None) == "" and tenant_salt("alice", shared=True) == ""


def _salts(redis_url: str, monkeypatch, shared: bool) -> dict[tuple[str, str], str]:
    """Each client's small (assigned in SubmitBatch) and large (background intake) batch, submitted by
    two API keys: the salt of each batch's payloads (one per batch)."""
    monkeypatch.setenv("FLEETBATCH_INTAKE_SYNC_MAX", "4")  # 4 queries or more: background intake
    config = GatewayConfig(
        redis_url=redis_url,
        offload=False,
        clusters=[ClusterSpec("a")],
        client_tokens=TOKENS,
        shared_prefix_cache=shared,
    )
    g = GatewayThread(config)
    address = g.start()
    queue = WorkQueue(connect(redis_url))
    out: dict[tuple[str, str], str] = {}
    try:
        for token, who in ((ALICE, "alice"), (BOB, "bob")):
            with channel(address, token=token) as ch:
                stub = pb_grpc.BatchServiceStub(ch)
                for size, n in (("small", 2), ("large", 6)):
                    bid = f"{who}-{size}"
                    stub.SubmitBatch(batch_of(n, batch_id=bid), timeout=60)
                    wait_until(
                        lambda bid=bid, n=n: all(
                            queue.r.hget(keys.query(keys.gid(bid, f"q{i}")), "payload") for i in range(n)
                        ),
                        60,
                        f"{bid}'s rows queued",
                    )
                    salts = {
                        json.loads(queue.r.hget(keys.query(keys.gid(bid, f"q{i}")), "payload"))["cache_salt"]
                        for i in range(n)
                    }
                    assert len(salts) == 1, salts
                    out[(who, size)] = salts.pop()
    finally:
        g.stop()
    return out


def test_two_api_keys_queue_their_rows_under_two_salts(redis_url, monkeypatch):
    salts = _salts(redis_url, monkeypatch, shared=False)
    assert salts[("alice", "small")] == salts[("alice", "large")] == tenant_salt("alice") != ""
    assert salts[("bob", "small")] == salts[("bob", "large")] == tenant_salt("bob") != ""
    assert tenant_salt("alice") != tenant_salt("bob")
    assert not any("alice" in s or "bob" in s for s in salts.values())


def test_the_shared_prefix_cache_option_queues_no_salt(redis_url, monkeypatch):
    assert set(_salts(redis_url, monkeypatch, shared=True).values()) == {""}


def test_the_shared_prefix_cache_flag_reaches_the_config():
    def config(*flags: str) -> GatewayConfig:
        args = resolve_config(build_parser().parse_args(["serve", *flags]), environ={})
        return GatewayConfig.from_args(args, redis_url="redis://x", admin_token="", clusters=[])

    assert config("--shared-prefix-cache").shared_prefix_cache
    assert not config().shared_prefix_cache
