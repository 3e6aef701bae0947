"""Share the LM head between the first and the last pipeline stage, by vocabulary rows, to balance them.

The last stage of a pipeline carries the LM head. On a small model with a large vocabulary that
is more than a layer's work (the ``small`` llama: hidden 512, vocabulary 8,192, 1.45 layers'
worth), and whole layers cannot balance it. The native engine can compute a share ``f`` of the
head's vocabulary rows on the first stage, which samples anyway: the last stage sends back the
final hidden states with its own rows' logits and the first stage adds its rows
(``engines.pipeline``). The vocabulary-parallel LM head of Megatron-style pipelines, here over
the two stages that meet at sampling.

``f`` makes the first and last stages' decode micro-batches equally long (a decode micro-batch
runs once per generated token; prefill takes the same share), within the first stage's memory.
The first stage's process is also the engine's driver: per micro-batch it schedules, builds and
sends the batch and applies its tokens. That work, measured by ``fleetbatch engine profile``
(``Problem.driver_s``), counts on the first stage's side of the balance; the stage latencies the
plan predicts stay those of the model's compute.
The search scores every candidate with its best share, so the layer partition is chosen knowing
it (``Problem.head_split``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from planner.memory import MemoryModel


class StageCosts(Protocol):
    """What the balance reads of the problem (:class:`planner.costs.Problem` is one): the head's and the
    driver's seconds on a device at a micro-batch size, and the memory model. Declared here, so this
    module needs nothing of :mod:`planner.costs`, which uses it."""

    @property
    def memory(self) -> MemoryModel: ...

    def head_s(self, dev: int, v: int) -> float: ...

    def driver_s(self, dev: int, v: int) -> float: ...


class Pipeline(Protocol):
    """What the balance reads of an assignment (:class:`planner.costs.Assignment` is one): its stages'
    devices in order and its micro-batch sizes."""

    @property
    def order(self) -> Sequence[int]: ...

    @property
    def v_prefill(self) -> int: ...

    @property
    def v_decode(self) -> int: ...


def head_share(dec_first: float, dec_last: float, head_first: float, head_last: float) -> float:
    """The share ``f`` in [0, 1] of head rows moved to the first stage that evens out
    ``dec_first + f * head_first`` and ``dec_last - f * head_last`` (``dec_last`` includes the whole head)."""
    if head_first + head_last <= 0 or dec_last <= dec_first:
        return 0.0
    return min(1.0, (dec_last - dec_first) / (head_first + head_last))


def split_head(
    problem: StageCosts, a: Pipeline, pre: list[float], dec: list[float], mem: list[int], cap: list[int]
) -> float:
    """Balance the first and last stage of ``a`` by a head share; updates ``pre``, ``dec`` and
    ``mem`` in place and returns the share (0 for one stage or when it would not help)."""
    if len(a.order) < 2:
        return 0.0
    first, last = a.order[0], a.order[-1]
    hf_d, hl_d = problem.head_s(first, a.v_decode), problem.head_s(last, a.v_decode)
    f = head_share(dec[0] + problem.driver_s(first, a.v_decode), dec[-1], hf_d, hl_d)
    weights = problem.memory.head_bytes(also_first=True)  # what the share costs the first stage at f = 1
    if f > 0 and weights > 0 and mem[0] + f * weights > cap[0]:
        f = max(0.0, (cap[0] - mem[0]) / weights)
    if f <= 0:
        return 0.0
    hf_p, hl_p = problem.head_s(first, a.v_prefill), problem.head_s(last, a.v_prefill)
    pre[0] += f * hf_p
    pre[-1] -= f * hl_p
    dec[0] += f * hf_d
    dec[-1] -= f * hl_d
    mem[0] += int(f * weights)
    return f
