"""The scheduler and the KV cache manager alone: admission, chunked prefill, freeing, preemption."""

from __future__ import annotations

import pytest

from engines.config import EngineConfig
from engines.interface import SamplingParams
from engines.kv_cache import KVCacheManager
from engines.scheduler import Scheduler
from engines.sequence import Sequence, SequenceStatus


def seq(rid: str, prompt: int, max_tokens: int = 100, predicted: int | None = None) -> Sequence:
    return Sequence(
        rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), predicted_tokens=predicted
    )


def advance(s: Scheduler) -> list[tuple[str, int, int]]:
    """One step without a model: computed tokens become cached, sampling chunks append a token."""
    out = s.schedule()
    for c in out.chunks:
        c.seq.num_computed += c.num_tokens
        if c.seq.num_computed == c.seq.num_tokens:
            c.seq.output_token_ids.append(7)
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


# ---- KV cache manager -------------------------------------------------------------------
def test_kv_allocate_grows_by_blocks_and_frees_everything():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    a, b = seq("a", 6), seq("b", 3)
    assert kv.allocate(a, 6) and a.block_table == [0, 1]
    assert kv.allocate(a, 8) and a.block_table == [0, 1]  # 8 tokens still fit 2 blocks
    assert kv.allocate(a, 9) and a.block_table == [0, 1, 2]
    assert kv.slots(a, 7, 10) == [7, 8, 9]
    assert kv.allocate(b, 8) and b.block_table == [3, 4]
    assert kv.num_free_blocks == 0 and kv.used_blocks == 5
    assert not kv.allocate(b, 9) and b.block_table == [3, 4]  # nothing taken on failure
    a.num_computed = 9
    assert kv.free(a) == 3 and a.block_table == [] and a.num_computed == 0
    assert kv.num_free_blocks == 3
    assert kv.allocate(b, 12) and b.block_table == [3, 4, 0]  # freed blocks are reused at once


def test_kv_manager_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 16)


# ---- scheduler ----------------------------------------------------------------------------
def make(budget_tokens=64, block=4, step_tokens=32, chunk=8, running=8, margin=0.0, default_pred=4):
    cfg = EngineConfig(
        kv_budget_tokens=budget_tokens,
        block_size=block,
        max_batch_tokens=step_tokens,
        prefill_chunk=chunk,
        max_running=running,
        safety_margin=margin,
        default_predicted_tokens=default_pred,
    )
    kv = KVCacheManager(budget_tokens // block, block)
    return Scheduler(cfg, kv), kv


def test_reservation_uses_prediction_margin_and_caps():
    s, _ = make(margin=0.5)
    assert s.reservation(seq("a", 10, max_tokens=100, predicted=20)) == 10 + 30
    assert s.reservation(seq("b", 10, max_tokens=12, predicted=20)) == 10 + 12  # capped at max_tokens
    assert s.reservation(seq("c", 10, max_tokens=100)) == 10 + 6  # default prediction 4 * 1.5


def test_admission_stops_at_kv_budget_by_predicted_length():
    s, kv = make(budget_tokens=64, step_tokens=64, chunk=16)
    for rid, p, pred in [("a", 10, 14), ("b", 8, 16), ("c", 4, 10), ("d", 2, 2)]:
        s.add(seq(rid, p, predicted=pred))
    # reservations: a 24, b 24, c 14 (total 62 > 64? no: 24+24=48, +14=62 <= 64), d 4 -> 66 > 64
    assert advance(s) == [("a", 0, 10), ("b", 0, 8), ("c", 0, 4)]
    assert [q.request_id for q in s.running] == ["a", "b", "c"] and [q.request_id for q in s.waiting] == ["d"]
    assert s.committed_tokens() == 62
    assert kv.used_blocks == 3 + 2 + 1


def test_chunked_prefill_token_budget_and_decode_first():
    s, _ = make(budget_tokens=256, step_tokens=10, chunk=6)
    s.add(seq("a", 14, predicted=4))
    s.add(seq("b", 3, predicted=4))
    assert advance(s) == [("a", 0, 6), ("b", 0, 3)]  # b joins in the same step (6 + 3 <= 10)
    assert advance(s) == [("a", 6, 6), ("b", 3, 1)]  # b decodes; a continues its prefill
    assert advance(s) == [("a", 12, 2), ("b", 4, 1)]  # a's last chunk samples its first token
    assert s.running[0].output_token_ids == [7]
    assert advance(s) == [("a", 14, 1), ("b", 5, 1)]


def test_max_running_limits_admission():
    s, _ = make(budget_tokens=1024, running=2)
    for i in range(4):
        s.add(seq(f"q{i}", 2))
    assert [r for r, _, _ in advance(s)] == ["q0", "q1"]
    assert len(s.waiting) == 2


def test_finish_frees_blocks_and_admits_the_next_at_once():
    s, kv = make(budget_tokens=32, step_tokens=64, chunk=16)
    s.add(seq("a", 8, predicted=8))
    s.add(seq("b", 8, predicted=8))
    s.add(seq("c", 8, predicted=8))
    assert [r for r, _, _ in advance(s)] == ["a", "b"]  # 16 + 16 = 32; c must wait
    a = s.running[0]
    s.finish(a)
    assert a.status is SequenceStatus.FINISHED and a.block_table == []
    assert kv.used_blocks == 2  # b: 8 tokens cached (its 9th is computed next step) -> 2 blocks
    assert advance(s) == [("b", 8, 1), ("c", 0, 8)]


def test_preemption_frees_the_most_recent_query_and_recomputes_it():
    # 4 blocks of 4 tokens; two queries predicted far too short both outgrow their reservation.
    s, kv = make(budget_tokens=16, step_tokens=64, chunk=16, default_pred=1)
    s.add(seq("a", 6, predicted=1))
    s.add(seq("b", 6, predicted=1))
    assert advance(s) == [("a", 0, 6), ("b", 0, 6)]  # 2 + 2 blocks, 7 tokens each after sampling
    assert advance(s) == [("a", 6, 1), ("b", 6, 1)]
    assert advance(s) == [("a", 7, 1), ("b", 7, 1)]  # 8 tokens cached each: still 2 blocks each
    out = s.schedule()  # a's 9th token needs a third block: none free -> b (admitted last) is preempted
    assert [c.seq.request_id for c in out.chunks] == ["a"] and [q.request_id for q in out.preempted] == ["b"]
    b = out.preempted[0]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed == 0
    assert b.output_token_ids == [7, 7, 7] and list(s.waiting) == [b]
    assert out.admitted == []  # nobody is admitted in a step that preempted
    assert kv.used_blocks == 3


def test_a_query_larger_than_the_whole_cache_is_stopped_not_looped():
    s, _ = make(budget_tokens=8, step_tokens=64, chunk=16)
    s.add(seq("big", 6, predicted=100))
    assert advance(s) == [("big", 0, 6)]  # prompt of 6 fits 2 blocks
    assert advance(s) == [("big", 6, 1)]
    assert advance(s) == [("big", 7, 1)]  # 8 tokens cached: the cache is full
    out = s.schedule()  # the 9th token needs a third block that does not exist
    assert [q.request_id for q in out.out_of_memory] == ["big"] and out.chunks == []
    assert not s.has_unfinished()
