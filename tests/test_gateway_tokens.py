"""The byte bound of prompt tokens (gateway/assign/tokens.py): an upper bound that lets a large batch skip tokenizing.

The bound must never be below the exact count (hypothesis, on the default tokenizer and on a
byte-level BPE that adds a prefix space); tokenizers it is not proved for get none. A large
batch validated with it tokenizes only prompts near their limit and rejects exactly what it
rejected before; the background intake then counts the rest, and every enqueued query carries
its exact count.
"""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.assign.tokens import token_bound
from gateway.checks.validation import InvalidBatch, Limits, check_batch
from gateway.config import ClusterSpec, GatewayConfig
from gateway.server import load_tokenizer, token_counter
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, wait_until
from workqueue import WorkQueue, connect, keys

DEFAULT = load_tokenizer(None)
# text: no lone surrogates (\ud800-\udfff), which both fronts refuse (gateway/http_api/format.py; protobuf's
# UTF-8 cannot carry them) and the tokenizer cannot encode
PIECES = st.one_of(
    st.characters(exclude_categories=["Cs"]),
    st.sampled_from(["<s>", "</s>", " ", "\n", "  ", "\ufdfa", "\u00e9", "\U0001f642"]),
)
TEXT = st.lists(PIECES, max_size=120).map("".join)


def byte_bpe(prefix_space: bool, normalizer=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog " * 20, "hello world " * 30], trainer
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok)


PREFIXED = byte_bpe(prefix_space=True)


@settings(max_examples=300, deadline=None)
@given(TEXT)
def test_the_bound_is_never_below_the_exact_count(text):
    for tok in (DEFAULT, PREFIXED):
        bound = token_bound(tok)
        assert bound is not None
        assert token_counter(tok)([text])[0] <= bound(text)


def test_tokenizers_the_bound_is_not_proved_for_get_none():
    assert token_bound(byte_bpe(False, normalizers.NFKD())) is None  # NFKD turns one character into many
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert token_bound(PreTrainedTokenizerFast(tokenizer_object=wordpiece)) is None
    assert token_bound(object()) is None


def batch(prompts: list[str]) -> pb.SubmitBatchRequest:
    req = pb.SubmitBatchRequest()
    for i, p in enumerate(prompts):
        req.queries.add(id=f"q{i}", prompt=p, max_tokens=8)
    return req


class Counting:
    """The real token counter, recording which prompts it was asked to count."""

    def __init__(self) -> None:
        self.count, self.seen = token_counter(DEFAULT), []

    def __call__(self, prompts: list[str]) -> list[int]:
        self.seen += prompts
        return self.count(prompts)


def test_a_bounded_check_counts_only_prompts_near_their_limit_and_rejects_the_same():
    limits = Limits(max_prompt_tokens=40, max_positions=64)
    short, near = "hello there", "word " * 30  # 150 bytes: the bound exceeds 40, the count does not
    counting = Counting()
    checked = check_batch(batch([short, near, short]), counting, limits, bound=token_bound(DEFAULT))
    assert counting.seen == [near]
    assert sorted(checked.uncounted) == [0, 2] and checked.uncounted[0] == 40
    assert checked.prompt_tokens[1] == token_counter(DEFAULT)([near])[0] <= 40
    too_long = "word " * 60
    for bound in (None, token_bound(DEFAULT)):  # rejected alike with and without the bound
        with pytest.raises(InvalidBatch) as e:
            check_batch(batch([short, too_long]), Counting(), limits, bound=bound)
        assert "query #1 ('q1'): prompt has" in str(e.value) and "the limit is 40" in str(e.value)


def test_a_large_batch_gets_exact_counts_from_the_intake(redis_url, monkeypatch):
    monkeypatch.setenv("FLEETBATCH_INTAKE_SYNC_MAX", "10")
    monkeypatch.setenv("FLEETBATCH_INTAKE_POLL_S", "0.05")
    prompts = [f"Tell me about {i} things " + "and more " * (i % 9) for i in range(300)]
    g = GatewayThread(GatewayConfig(redis_url=redis_url, offload=False, clusters=[ClusterSpec("a")]))
    queue = WorkQueue(connect(redis_url))
    with grpc.insecure_channel(g.start()) as ch:
        stub = pb_grpc.BatchServiceStub(ch)
        req = batch(prompts)
        req.batch_id = "big"
        assert stub.SubmitBatch(req).status == pb.VALIDATING
        wait_until(
            lambda: int(queue.r.hget(keys.batch("big"), "intake_done") or 0) == 300, 60, "intake", 0.05
        )
        req = batch(prompts[:20] + ["x " * 3000])  # one prompt past 2,048 tokens: nothing is enqueued
        req.batch_id = "bad"
        with pytest.raises(grpc.RpcError) as e:
            stub.SubmitBatch(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "q20" in e.value.details()
    g.stop()
    exact = token_counter(DEFAULT)(prompts)
    for i in (0, 1, 150, 299):
        payload = json.loads(queue.r.hget(keys.query(f"big:q{i}"), "payload"))
        assert payload["prompt_tokens"] == exact[i]
    assert queue.batch("bad") is None and len(queue.queued_ids("a")) == 300
