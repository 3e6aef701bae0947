"""Simulated engines: the real iteration-level scheduler, and the real static batcher, in cost-model time.

:class:`IterationEngine` holds a real :class:`engines.scheduler.Scheduler` and
:class:`engines.kv_cache.KVCacheManager` and does what :meth:`engines.engine.LLMEngine.step`
does with one stage -- ``schedule()``, "run" (the step's time from :mod:`sim.costs`), update:
computed tokens become cached, a sampling chunk appends a token, a query that reached its
forced length finishes and ``Scheduler.finish`` frees its blocks. How many queries it takes
from its queue before a step is the real ``LLMEngine.free_slots`` (called on this object,
which has the ``config``, ``scheduler`` and ``kv`` it reads), as :mod:`engines.worker` does.

**Bulk decode.** A step after which (1) nobody was admitted, preempted or finished, (2) every
running query decoded one token and (3) nothing was added to the waiting line is *steady*: the
scheduler will repeat it exactly until the next query finishes. Admission stays blocked
(committed KV and block use only grow, the running count and the step's token budget stay,
the head of the waiting line stays), ``free_slots`` only shrinks, and no query is preempted as
long as the free blocks cover every query's growth (checked). So the next ``k`` steps, ``k``
being the fewest tokens any running query still has to generate, are applied at once: the
same block allocations, token counts and finishes the real scheduler would make one step at a
time (``tests/test_sim_exact.py`` compares step by step with the real ``LLMEngine``). A bulk is
cut short at the next step boundary when work arrives for an engine that would take it.

:class:`StaticEngine` is :class:`engines.static_engine.StaticBatchEngine`'s own queue, batch
choice (``_take_batch``) and ``free_slots``; its ``model.generate`` is modelled: prompts padded
to the longest, every query of the batch decoding until the longest forced length is reached.
"""

from __future__ import annotations

import math

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.kv_cache import KVCacheManager
from engines.scheduler import Scheduler, SchedulerOutput
from engines.sequence import Sequence
from engines.static_engine import StaticBatchEngine, batch_forwards
from sim.costs import LinearCost
from sim.workload import Workload

Trace = list[
    tuple[list[str], list[str], int, int]
]  # per step: admitted, finished ids, tokens computed, KV held


def prefix_keys(work: Workload, qid: int, block_size: int, num_tokens: int) -> list[int]:
    """Prefix-cache keys of query ``qid``'s first ``ceil(num_tokens / block_size)`` blocks, equal where the
    engine's hash-chained keys (:func:`engines.kv_cache.block_keys`) would be: a block wholly inside the
    head it shares with its prefix group (``Workload.prefix_group``, ``prefix_tokens``) has the group's
    key for that position, every later block one of its own. Set on the sequence up front, they spare
    the simulator hashing its token ids (the ids are zeros)."""
    n = -(-num_tokens // block_size)
    g = work.prefix_group[qid] if work.prefix_group else None
    shared = min(n, work.prefix_tokens[qid] // block_size) if g is not None and work.prefix_tokens else 0
    head, own = (g + 1 if g is not None else 0) << 32, -((qid + 1) << 24)
    return [head + j for j in range(shared)] + [own - j for j in range(shared, n)]


class SimSequence(Sequence):
    """The real :class:`Sequence`, compared by identity.

    The dataclass's generated ``__eq__`` compares all 18 fields, and ``Scheduler.finish`` /
    ``remove`` find a query with ``list.remove``, which compares it with every query ahead of it.
    Live queries have unique ids, so no two are ever equal field by field: identity gives the same
    answers, without building two 18-field tuples per comparison.
    """

    __eq__ = object.__eq__
    __hash__ = object.__hash__
    upper: int = 0  # max(reserved, prompt + forced length), set at admission (IterationEngine.free_slots)


class IterationEngine:
    """The native engine's scheduling in cost-model time (see the module docstring)."""

    AUDIT = False  # tests: compare every free_slots shortcut with the real method
    #: per query, the tokens of the partial output it resumes from (sim.spot; None: every query starts afresh):
    #: its output starts with them (``Sequence.from_request``), so it is prefilled with its prompt and those and
    #: decodes only the rest of its forced length
    resumed: list[int] | None = None

    def __init__(
        self, config: EngineConfig, cost: LinearCost, work: Workload, max_tokens: int = 256, bulk: bool = True
    ) -> None:
        config.validate()
        self.config = config
        self.cost = cost
        self.work = work
        self.max_tokens = max_tokens
        self.bulk = bulk
        blocks = max(1, config.kv_budget_tokens // config.block_size)
        self.kv = KVCacheManager(blocks, config.block_size, prefix_cache=config.prefix_cache)
        self.prefill_tokens = 0  # prompt tokens computed (charged by the cost model): cached ones are not
        self.scheduler = Scheduler(config, self.kv)
        self.trace: Trace | None = None
        self.num_steps = 0
        self.generated_tokens = 0
        self.cumulative_kv_tokens = 0  # LLMEngine's figure: sum over steps of cached tokens of the batch
        self.kv_cached_token_seconds = 0.0  # the same, each step weighted by its duration
        # the worker's kv_token_seconds (MICO's cumulative KV): KV held while a step runs (the engine's
        # kv_step_tokens: used blocks x block size once the step is scheduled) x the step's seconds
        self.kv_token_seconds = 0.0
        self.failed: list[int] = []  # queries larger than the whole cache
        self.num_preemptions = 0
        self._kv_step = 0
        self._plan: SchedulerOutput | None = None
        self._dt = 0.0
        self._bulk_k = 0
        self._steady = False
        self._full = False
        self._added = False
        self._upper = 0  # U of free_slots: sum over running of max(reserved, prompt + forced length)

    # ---- the worker side ------------------------------------------------------------------
    def free_slots(self) -> int:
        """``LLMEngine.free_slots`` (the real method, on this object's config, scheduler and KV).

        It is ``max(0, min(room, floor(free_kv / typical)) + queue_depth - waiting)``, ``typical``
        being the mean reservation of the running queries. Two cases give it without the sums over
        the batch (a ``reservation()`` call per running query, once per pull): ``room <= 0``, and
        ``total - U >= room * (U + R) / R``, where ``U`` (kept up to date on admission, finish and
        preemption) sums ``max(reserved, prompt + forced length)`` over the ``R`` running queries, so
        ``U >= committed`` and ``(U + R) / R >= typical`` (a running query's reservation is
        ``max(base, tokens + 1) <= max(reserved, tokens) + 1``). ``AUDIT`` checks both.
        """
        s, cfg = self.scheduler, self.config
        room = cfg.max_running - len(s.running)
        quick = None
        if room <= 0:
            quick = max(0, room + cfg.queue_depth - len(s.waiting))
        elif s.running:
            u, r = self._upper, len(s.running)
            if self.kv.total_tokens - u >= room * max(1.0, (u + r) / r):
                quick = max(0, room + cfg.queue_depth - len(s.waiting))
        if quick is None or self.AUDIT:
            real = LLMEngine.free_slots(self)
            if quick is not None and quick != real:
                raise AssertionError(f"free_slots shortcut {quick} != real {real}")
            return real
        return quick

    def add(self, qid: int) -> None:
        w = self.work
        if w.prompt_tokens[qid] + 1 > self.kv.total_tokens:  # LLMEngine.add_request answers with an error
            self.failed.append(qid)
            return
        pred = int(w.predicted_tokens[qid])
        n = w.prompt_tokens[qid]
        seq = SimSequence(
            str(qid),
            [0] * n,
            SamplingParams(max_tokens=self.max_tokens, forced_length=w.true_tokens[qid]),
            predicted_tokens=pred or None,
        )
        if self.resumed is not None and self.resumed[qid]:  # as Sequence.from_request resumes one
            seq.output_token_ids = [0] * self.resumed[qid]
        if self.kv.prefix_cache:  # keys for every block it can fill: prompt and output
            seq.block_keys = prefix_keys(
                w, qid, self.kv.block_size, n + max(self.max_tokens, w.true_tokens[qid])
            )
        self.scheduler.add(seq)
        self._added = True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def held(self) -> list[tuple[int, int]]:
        """The queries it holds (running, then waiting) and the tokens of each one's output now (what it resumed
        from included), for a cluster that stops (sim.spot): they leave with the engine."""
        sched = self.scheduler
        return [(int(s.request_id), len(s.output_token_ids)) for s in [*sched.running, *sched.waiting]]

    @property
    def kv_used_tokens(self) -> int:
        return self.kv.used_blocks * self.kv.block_size

    # ---- steps ----------------------------------------------------------------------------
    def _account(self, plan: SchedulerOutput) -> None:
        """What a schedule did to the bounds and counts: queries admitted, preempted, failed (no room)."""
        for seq in plan.admitted:
            seq.upper = max(seq.reserved_tokens, seq.num_prompt_tokens + seq.sampling.forced_length)
            self._upper += seq.upper
        for seq in plan.preempted + plan.out_of_memory:
            self._upper -= seq.upper
        self.failed.extend(int(s.request_id) for s in plan.out_of_memory)
        self.num_preemptions += len(plan.preempted)

    def start_step(self) -> float | None:
        """Plan the next step (or bulk of steps); its duration in seconds, or None when there is nothing to run."""
        if self.bulk and (self._full or (self._steady and not self._added)):
            k = self._bulk_steps()
            if k >= 2:
                self._bulk_k = k
                self._dt = self.cost.step_s(0, len(self.scheduler.running))
                return k * self._dt
        self._added = False
        plan = self.scheduler.schedule()
        self._kv_step = self.kv.used_blocks * self.kv.block_size  # LLMEngine.step: held while this step runs
        self._account(plan)
        if not plan.chunks:
            self._plan = None
            return None
        prefill, decode, _ = plan.forward()
        self.prefill_tokens += prefill
        self._plan = plan
        self._dt = self.cost.step_s(prefill, decode)
        return self._dt

    def _bulk_steps(self) -> int:
        running = self.scheduler.running
        k = min([s.sampling.forced_length - len(s.output_token_ids) for s in running])
        bs = self.kv.block_size
        need = 0
        for s in running:
            extra = -(-(s.num_computed + k) // bs) - len(s.block_table)  # blocks_for(...) - held
            if extra > 0:
                need += extra
        return k if need <= self.kv.num_free_blocks else 0

    def cut_bulk(self, elapsed: float) -> float | None:
        """Work arrived ``elapsed`` s into a bulk: end it at the next step boundary; the new duration, or None."""
        if not self._bulk_k:
            return None
        m = max(1, math.ceil(elapsed / self._dt - 1e-9))
        if m >= self._bulk_k:
            return None
        self._bulk_k = m
        return m * self._dt

    @property
    def in_bulk(self) -> bool:
        return self._bulk_k > 0

    def end_step(self) -> list[int]:
        """Apply the planned step(s); the queries finished, in the engine's order."""
        if self._bulk_k:
            return self._end_bulk()
        plan, sched = self._plan, self.scheduler
        self._plan = None
        cached = 0
        sampling: list[Sequence] = []
        for c in plan.chunks:  # a chunk samples when it reaches the end of its query (ScheduledChunk.samples)
            seq = c.seq
            seq.num_computed += c.num_tokens
            self.kv.commit(seq)  # its new full blocks join the prefix cache (Scheduler.update)
            cached += seq.num_computed
            if seq.num_computed == len(seq.prompt_token_ids) + len(seq.output_token_ids):
                sampling.append(seq)
        self.cumulative_kv_tokens += cached
        self.kv_cached_token_seconds += cached * self._dt
        self.kv_token_seconds += self._kv_step * self._dt
        self.num_steps += 1
        done: list[Sequence] = []
        for seq in sampling:
            out = seq.output_token_ids
            out.append(0)
            if len(out) >= seq.sampling.forced_length:
                sched.finish(seq)
                self._upper -= seq.upper
                done.append(seq)
        sampled = len(sampling)
        self.generated_tokens += sampled
        # every running query sampled: all of them decode next step
        decoding = not done and not plan.preempted and len(plan.chunks) == sampled == len(sched.running)
        self._steady = decoding and not plan.admitted and all(c.num_tokens == 1 for c in plan.chunks)
        # A full batch of decoding queries admits nobody until one finishes, whatever waits.
        cfg = self.config
        self._full = (
            decoding and cfg.max_running <= sampled <= cfg.max_batch_tokens and cfg.decode_micro_batch is None
        )
        if self.trace is not None:
            self.trace.append(
                (
                    [s.request_id for s in plan.admitted],
                    [s.request_id for s in done],
                    plan.num_tokens,
                    self._kv_step,
                )
            )
        return [int(s.request_id) for s in done]

    def _end_bulk(self) -> list[int]:
        k, running, sched = self._bulk_k, self.scheduler.running, self.scheduler
        self._bulk_k = 0
        r = len(running)
        pad = [0] * k
        done = []
        kv, bs = self.kv, self.kv.block_size
        cached0 = 0
        held = 0  # sum over the k steps of blocks held: step j holds ceil((computed + j) / bs) per query
        start = [s.num_computed for s in running] if self.trace is not None else []
        for seq in running:
            a = seq.num_computed
            cached0 += a
            # held += F(a + k) - F(a), F(n) = sum(ceil(x / bs) for x in 1..n) = bs q (q + 1) / 2 + r (q + 1)
            q0, r0 = divmod(a, bs)
            q1, r1 = divmod(a + k, bs)
            held += (bs * q1 * (q1 + 1) >> 1) + r1 * (q1 + 1) - (bs * q0 * (q0 + 1) >> 1) - r0 * (q0 + 1)
            seq.num_computed += k
            seq.output_token_ids.extend(pad)
            # the blocks the k steps' allocations took (checked free before the bulk; cannot fail)
            if -(-seq.num_computed // bs) > len(seq.block_table) and not kv.allocate(seq, seq.num_computed):
                raise RuntimeError("bulk decode ran out of KV blocks")
            kv.commit(seq)
            if len(seq.output_token_ids) >= seq.sampling.forced_length:
                done.append(seq)
        step_sums = k * cached0 + r * k * (k + 1) // 2
        self.cumulative_kv_tokens += step_sums
        self.kv_cached_token_seconds += step_sums * self._dt
        self.kv_token_seconds += held * bs * self._dt
        self.num_steps += k
        self.generated_tokens += r * k
        for seq in done:
            sched.finish(seq)
            self._upper -= seq.upper
        self._steady = not done
        self._full = self._full and not done
        if self.trace is not None:
            for j in range(1, k + 1):
                kv_j = bs * sum(-(-(a + j) // bs) for a in start)
                self.trace.append(([], [s.request_id for s in done] if j == k else [], r, kv_j))
        return [int(s.request_id) for s in done]


class _NoModel:
    """Stands in for the Hugging Face model of :class:`StaticBatchEngine` (only ``eval()`` is called)."""

    def eval(self) -> _NoModel:
        return self


class StaticEngine:
    """Static batching (MICO's baseline): the real static engine's batching, ``generate`` modelled."""

    def __init__(self, max_batch: int, cost: LinearCost, work: Workload, max_tokens: int = 256) -> None:
        self.engine = StaticBatchEngine(_NoModel(), None, max_batch=max_batch)
        self.cost = cost
        self.work = work
        self.max_tokens = max_tokens
        self.trace: Trace | None = None
        self.num_steps = 0
        self.generated_tokens = 0
        self.cumulative_kv_tokens = 0
        self.kv_cached_token_seconds = 0.0
        self.kv_token_seconds = 0.0
        self.failed: list[int] = []
        self.kv_used_tokens = 0
        self._kv_step = 0
        self._batch: list[Request] = []
        self.in_bulk = False

    def free_slots(self) -> int:
        return self.engine.free_slots()

    def add(self, qid: int) -> None:
        w = self.work
        sampling = SamplingParams(max_tokens=self.max_tokens, forced_length=w.true_tokens[qid])
        # the worker hands over text, which the static engine tokenizes and cuts to its last max_prompt_tokens
        ids = [0] * min(w.prompt_tokens[qid], self.engine.max_prompt_tokens)
        self.engine.add_request(Request(str(qid), "", sampling, prompt_token_ids=ids))

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished() or bool(self._batch)

    def start_step(self) -> float | None:
        batch = self.engine._take_batch()
        if not batch:
            return None
        self._batch = batch
        b = len(batch)
        longest = max(len(r.prompt_token_ids) for r in batch)
        new = max(r.sampling.target_tokens for r in batch)
        forwards = batch_forwards(b, longest, new)  # what the real engine reports to an emulated device
        duration = self.cost.forwards_s(forwards)
        prefill = self.cost.step_s(b * longest, 0)
        decode = self.cost.step_s(0, b)
        # Hugging Face generate keeps every row (padded) until the longest is done; the engine reports
        # (kv_step_tokens) and the worker charges the batch's whole size for the whole step
        cached_sum = b * longest + b * (new * longest + new * (new + 1) // 2)
        self.cumulative_kv_tokens += cached_sum
        self.kv_cached_token_seconds += b * longest * prefill + decode * b * (
            new * longest + new * (new + 1) // 2
        )
        self.kv_used_tokens = self._kv_step = b * (longest + new)
        self.kv_token_seconds += self._kv_step * duration
        self.num_steps += sum(n for _, _, n in forwards)
        return duration

    def cut_bulk(self, elapsed: float) -> float | None:
        return None

    def end_step(self) -> list[int]:
        batch, self._batch = self._batch, []
        self.kv_used_tokens = 0
        self.generated_tokens += sum(min(r.sampling.target_tokens, self.max_tokens) for r in batch)
        if self.trace is not None:
            ids = [r.request_id for r in batch]
            self.trace.append((ids, ids, 0, self._kv_step))
        return [int(r.request_id) for r in batch]
