"""Iteration-level scheduler: at every step, which running queries compute which tokens, who is admitted.

Each step the running queries go first (in admission order): a decoding query computes one
token, a query still in prefill computes its next chunk (at most ``prefill_chunk`` tokens).
Then waiting queries are admitted, first come first served, while (1) the KV *reservation*
of the running batch plus the newcomer's stays within the KV budget, where a query reserves
``prompt + predicted * (1 + safety_margin)`` tokens (never more than ``prompt + max_tokens``),
(2) the step's token budget and ``max_running`` allow, and (3) the first prefill chunk's
blocks are free. A query that outgrows its prediction takes blocks from the free pool; when
the pool is empty the most recently admitted query is preempted (its blocks are freed and it
is recomputed later from its prompt and the tokens it already generated), never an OOM.

With the prefix cache on (:mod:`engines.kv_cache`), an admitted query first takes the longest
run of cached blocks matching its tokens and prefills only the rest; a preempted query often
finds its own blocks still cached. Shared blocks are counted once in the KV budget: a query
reserves its own part (its reservation less its cached tokens), and the cached blocks the
running queries hold are added once.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engines.config import EngineConfig
from engines.kv_cache import KVCacheManager
from engines.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at position ``start`` are computed this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a new token is sampled after it."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    out_of_memory: list[Sequence] = field(default_factory=list)  # alone and still larger than the whole cache

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def forward(self) -> tuple[int, int, int]:
        """``(prefill tokens, decoded queries, 1)``: this step's forward pass, as :mod:`engines.device`
        charges it. A decode is one token that follows the query's last sampled token; any other
        chunk (prompt, or recomputation after a preemption) is prefill. Read it before the update."""
        prefill = decode = 0
        for c in self.chunks:
            out = c.seq.output_token_ids
            if c.num_tokens == 1 and out and c.start + 1 == len(c.seq.prompt_token_ids) + len(out):
                decode += 1
            else:
                prefill += c.num_tokens
        return prefill, decode, 1


class Scheduler:
    """Owns the request state (as vLLM v1's scheduler does): which queries wait, run and are known,
    what each step computes (:meth:`schedule`), and what a step's sampled tokens change
    (:meth:`update_from_output`: computed counts, output tokens, stop rules, finishing)."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        eos_token_id: int | None = None,
        max_positions: int | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_id = eos_token_id
        self.max_positions = max_positions
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}  # every unfinished query, by id

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def remove(self, request_id: str) -> Sequence | None:
        """Take a query out (abort), freeing its blocks; None if it is not here."""
        self.requests.pop(request_id, None)
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self.kv.free(seq)
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """A query is done: leave the batch and free its KV blocks at once."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        self.requests.pop(seq.request_id, None)

    # ---- after a step -----------------------------------------------------------------
    def update_from_output(
        self, plan: SchedulerOutput, sampled: list[Sequence], tokens: list[int], now: float
    ) -> list[tuple[Sequence, str]]:
        """Apply a step: its chunks are computed, each sampled query gets its token; returns the
        queries that finished with their reason (``stop`` or ``length``), already freed."""
        for c in plan.chunks:
            c.seq.num_computed += c.num_tokens
            self.kv.commit(c.seq)
        done = []
        for seq, tok in zip(sampled, tokens, strict=True):
            seq.output_token_ids.append(tok)
            if not seq.first_token_time:  # its first token (of this run, when it resumed a partial output)
                seq.first_token_time = now
            reason = self.stop_reason(seq, tok)
            if reason:
                self.finish(seq)
                done.append((seq, reason))
        return done

    def stop_reason(self, seq: Sequence, tok: int) -> str:
        """Why ``seq`` stops after sampling ``tok`` (``""``: it goes on; the rule: ``SamplingParams.stop_reason``)."""
        n = len(seq.output_token_ids)
        return seq.sampling.stop_reason(n, tok, self.eos_token_id, seq.num_tokens, self.max_positions)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- admission accounting ---------------------------------------------------------
    def reservation(self, seq: Sequence) -> int:
        """KV tokens a query sets aside when admitted: prompt + predicted * (1 + margin), capped."""
        target = seq.sampling.target_tokens
        predicted = (
            seq.predicted_tokens if seq.predicted_tokens is not None else self.config.default_predicted_tokens
        )
        predicted = min(max(1, predicted), target)
        tokens = seq.num_prompt_tokens + math.ceil(predicted * (1 + self.config.safety_margin))
        tokens = min(tokens, seq.num_prompt_tokens + target)
        return max(tokens, seq.num_tokens + 1)  # a recomputed query needs at least what it already has

    def committed_tokens(self) -> int:
        """KV tokens the running batch holds or has reserved (whichever is larger per query), each
        query's cached blocks apart and the cached blocks they share counted once."""
        own = sum(max(s.reserved_tokens, s.num_tokens - s.num_cached_tokens) for s in self.running)
        bs = self.kv.block_size
        shared = {
            b for s in self.running if s.num_cached_tokens for b in s.block_table[: s.num_cached_tokens // bs]
        }
        if not shared:
            return own
        # a shared block that a running query computed itself is in its own part already: once is enough
        counted = sum(
            1 for s in self.running for b in s.block_table[s.num_cached_tokens // bs :] if b in shared
        )
        return own + (len(shared) - counted) * bs

    # ---- the step ---------------------------------------------------------------------
    def schedule(self, busy: frozenset[str] | set[str] = frozenset()) -> SchedulerOutput:
        """The next step (or micro-batch): running queries not in ``busy`` first, then admissions.

        ``busy`` holds the ids of queries in a micro-batch still in flight through the pipeline
        stages; they are neither scheduled nor preempted (their KV is being written). Per
        micro-batch at most ``decode_micro_batch`` decoding and ``prefill_micro_batch``
        prefilling queries are taken when those limits are set (they come from the plan).
        """
        cfg, kv = self.config, self.kv
        out = SchedulerOutput()
        budget = cfg.max_batch_tokens
        room = {True: cfg.decode_micro_batch or math.inf, False: cfg.prefill_micro_batch or math.inf}
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.request_id in busy:
                i += 1
                continue
            n = seq.num_uncomputed
            decode = n == 1
            if room[decode] <= 0:
                i += 1
                continue
            n = 1 if decode else min(n, cfg.prefill_chunk, budget)
            scheduled = True
            while not kv.allocate(seq, seq.num_computed + n):
                victim = self._victim(busy)  # the most recently admitted idle query gives way
                if victim is None:  # only queries in flight could give way: wait for them
                    scheduled = False
                    break
                self.running.remove(victim)
                if victim is seq and not self.running and not out.chunks:
                    out.out_of_memory.append(victim)  # alone and larger than the cache: cannot ever fit
                    kv.free(victim)
                    victim.status = SequenceStatus.FINISHED
                    self.requests.pop(victim.request_id, None)
                else:
                    self._preempt(victim)
                    out.preempted.append(victim)
                if victim is seq:
                    scheduled = False
                    break
            if not scheduled:
                break
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            room[decode] -= 1
            budget -= n
            i += 1
        if out.preempted:
            return out  # memory is short: admit nobody this step
        while self.waiting and budget > 0 and len(self.running) < cfg.max_running and room[False] > 0:
            seq = self.waiting[0]
            hit = kv.lookup(seq)
            cached = len(hit) * kv.block_size
            reserve = self.reservation(seq) - cached  # its own part; the cached blocks are shared
            unheld = sum(kv.refcount(b) == 0 for b in hit) * kv.block_size  # not yet counted
            if self.running and self.committed_tokens() + reserve + unheld > kv.total_tokens:
                break
            n = min(seq.num_tokens - cached, cfg.prefill_chunk, budget)
            if not kv.admit(seq, hit, cached + n):
                break
            self.waiting.popleft()
            seq.reserved_tokens = reserve
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            out.chunks.append(ScheduledChunk(seq, cached, n))
            room[False] -= 1
            budget -= n
        return out

    def _victim(self, busy: frozenset[str] | set[str]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq.request_id not in busy:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)  # recompute later: prompt + generated tokens are prefilled again
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
