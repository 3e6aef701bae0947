"""The planning problem and the cost of one candidate plan (the objective every method is scored by).

A candidate assigns the pipeline stages to an ordered list of devices (every listed device is
a stage), gives each stage a run of consecutive layers and each layer a bit width, and picks a
prefill and a decode micro-batch size. With ``m_p = ceil(B / v_p)`` prefill and
``m_d = ceil(B / v_d)`` decode micro-batches and per-stage times ``P_k`` (one prefill
micro-batch) and ``D_k`` (one decode step of one micro-batch):

    prefill = sum_k P_k + (m_p * kappa - 1) * max_k P_k
    decode  = (n - 1) * max(sum_k D_k, m_d * max_k D_k)
    objective = prefill + decode + theta * sum_l omega_norm[l][b_l]

With chunked prefill (SplitQuant's kappa) every prefill micro-batch is cut into ``kappa``
chunks of ``s / kappa`` prompt tokens that flow through the pipeline one after another, so the
pipeline holds ``m_p * kappa`` prefill items and ``P_k`` is the time of one chunk (the layer
work of a whole micro-batch / kappa, with the per-call overheads paid per chunk, see
``LatencyModel.prefill_chunked_s``; its activations / kappa over the link; the LM head in full
on every chunk). kappa = 1 is unchunked prefill.

The decode term is the steady state of a pipeline whose micro-batches each need a token's
round trip through all stages before their next step: it is right for any ``m_d`` (LLM-PQ's
``sum + (m-1) max`` form is right only when ``m_d`` >= number of stages). Stage times include
receiving the activations from the previous stage over the link, and the LM head on the last
(measured when the device's profile timed it, ``LatencyModel.head_s``, else the roofline). With
``Problem.head_split`` the first stage takes a share of the head's rows that evens out the first
and last stages (``planner.head_split``; the native engine runs it, vLLM does not).

Emulated slower devices (a device type's ``slowdown``, ``planner.catalog.with_slowdown``): the
latency model of such a type is already scaled by ``1 + slowdown`` (``planner.problem``), measured
LM head included, and so are the roofline LM head and the fixed per-layer overhead used for tensor
parallelism; links, all-reduce latencies and memory are not slowed.

Tensor parallelism (SplitQuant): a stage may run on a *unit*, a group of ``t`` devices of one
type on one node (``t`` in {1, 2, 4}, dividing the heads and KV heads). Unit ids ``0..n-1`` are
the single devices; larger groups get ids ``n, n+1, ...`` (``Problem.tp_unit``), so
``Assignment.order`` holds unit ids and the ILP and heuristics need no change. On a unit every
device holds 1/t of the stage's layer weights and KV cache (embeddings, LM head and activations
are counted in full on every device: conservative); a layer's time is its single-device time
with the part above the fixed per-layer overhead divided by t, plus two ring all-reduces of the
layer's output activations (``2 (t-1)/t * bytes / intra-node bandwidth + latency`` each).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from planner.cluster import Cluster
from planner.head_split import split_head
from planner.latency import LatencyModel, lm_head_s
from planner.memory import MemoryModel, usable_bytes
from planner.modelshape import ModelShape

DEFAULT_BITS = (3, 4, 8, 16)


@dataclass(frozen=True)
class Workload:
    batch: int
    prompt_len: int
    output_tokens: int
    kv_bits: int = 16
    bits: tuple[int, ...] = DEFAULT_BITS
    theta: float = 1.0

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch}")
        if self.prompt_len < 1:
            raise ValueError(f"prompt length must be >= 1, got {self.prompt_len}")
        if self.output_tokens < 1:
            raise ValueError(f"expected output tokens must be >= 1, got {self.output_tokens}")
        if not self.bits:
            raise ValueError("need at least one bit width")
        if self.theta < 0:
            raise ValueError(f"theta must be >= 0, got {self.theta}")

    @property
    def mean_context(self) -> float:
        """Mean number of cached tokens over the decode steps."""
        return self.prompt_len + self.output_tokens / 2


@dataclass(frozen=True)
class Assignment:
    """One candidate plan: ``order[k]`` is the unit of stage ``k``: a cluster device index, or the id of a
    tensor-parallel group (``Problem.tp_unit`` / ``Problem.unit_devices``)."""

    order: tuple[int, ...]
    stage_layers: tuple[int, ...]
    bits: tuple[int, ...]
    v_prefill: int
    v_decode: int
    kappa: int = 1  # prefill chunks per micro-batch (SplitQuant); 1 = unchunked

    def __post_init__(self) -> None:
        if self.kappa < 1:
            raise ValueError(f"prefill chunks kappa must be >= 1, got {self.kappa}")

    def layer_ranges(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.stage_layers:
            out.append((start, start + n))
            start += n
        return out


@dataclass
class Evaluation:
    stage_prefill_s: list[float]
    stage_decode_s: list[float]
    stage_memory_bytes: list[int]
    stage_capacity_bytes: list[int]
    prefill_s: float
    decode_s: float
    omega: float
    objective: float
    throughput: float
    head_split: float = 0.0  # share of LM-head rows on the first stage (planner.head_split)

    @property
    def latency_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.stage_memory_bytes, self.stage_capacity_bytes, strict=True))


@dataclass
class Problem:
    """Cluster + model + workload + quality indicator + per-device-type latency models."""

    cluster: Cluster
    shape: ModelShape
    workload: Workload
    omega: dict[int, dict[int, float]]
    latency: dict[str, LatencyModel]
    head_split: bool = False  # score plans with the LM head shared by the first and last stage
    # only layer weights count against the devices' budgets (emulated devices, ``planner.fleet``: the
    # KV pool, embeddings, LM head and activations are granted apart), so bits decide what fits
    weights_only: bool = False
    _cache: dict = field(default_factory=dict, repr=False)
    _units: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._units = [(i,) for i in range(len(self.cluster.devices))]
        L = self.shape.layers
        missing = [i for i in range(L) if i not in self.omega]
        if missing:
            raise ValueError(f"quality indicator lacks layers {missing[:5]} (model has {L} layers)")
        for i in range(L):
            for b in self.workload.bits:
                if b not in self.omega[i]:
                    raise ValueError(f"quality indicator lacks {b}-bit values for layer {i}")
        for d in self.cluster.devices:
            if d.type.name not in self.latency:
                raise ValueError(f"no latency model for device type {d.type.name}")
            lm = self.latency[d.type.name]
            absent = [b for b in self.workload.bits if b not in lm.prefill_coef]
            if absent:
                raise ValueError(f"latency model for {d.type.name} lacks bit widths {absent}")

    @property
    def layers(self) -> int:
        return self.shape.layers

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(sorted(self.workload.bits))

    @cached_property
    def memory(self) -> MemoryModel:
        w = self.workload
        return MemoryModel(self.shape, w.batch, w.prompt_len, w.output_tokens, w.kv_bits)

    @cached_property
    def omega_scale(self) -> float:
        """Normalises omega so that all layers at the lowest bit width sum to 1."""
        lo = min(self.workload.bits)
        tot = sum(self.omega[i][lo] for i in range(self.layers))
        return 1.0 / tot if tot > 0 else 1.0

    def micro_batches(self, v: int) -> int:
        return math.ceil(self.workload.batch / v)

    # ---- stage units: single devices (ids 0..n-1) and tensor-parallel groups (ids n, n+1, ...)

    def tp_allowed(self, t: int) -> bool:
        """Whether the model's heads, KV heads and MLP width split evenly over ``t`` devices."""
        sh = self.shape
        return t >= 1 and sh.heads % t == 0 and sh.kv_heads % t == 0 and sh.intermediate % t == 0

    def tp_unit(self, devices: Sequence[int]) -> int:
        """Unit id of a tensor-parallel group (registered on first use); a single device is its own id."""
        group = tuple(devices)
        if len(group) == 1:
            return group[0]
        c = self.cluster.devices
        if len(set(group)) != len(group) or not all(0 <= i < len(c) for i in group):
            raise ValueError(f"bad tensor-parallel group {group}")
        if len({(c[i].node, c[i].type.name) for i in group}) != 1:
            raise ValueError(f"tensor-parallel group {group} mixes nodes or device types")
        if not self.tp_allowed(len(group)):
            raise ValueError(f"{self.shape.name} does not split over {len(group)} devices")
        if group not in self._units:
            self._units.append(group)
        return self._units.index(group)

    def unit_devices(self, u: int) -> tuple[int, ...]:
        return self._units[u]

    def unit_tp(self, u: int) -> int:
        return len(self._units[u])

    def _lead(self, u: int) -> int:
        return self._units[u][0]

    def _dtype(self, u: int):
        return self.cluster.devices[self._units[u][0]].type

    def allreduce_s(self, u: int, nbytes: float) -> float:
        """One ring all-reduce of ``nbytes`` over the devices of unit ``u`` (0 for a single device)."""
        g = self._units[u]
        t = len(g)
        if t == 1:
            return 0.0
        bw = self.cluster.bandwidth_bytes_per_s(g[0], g[1])
        return 2 * (t - 1) / t * nbytes / bw + self._dtype(u).allreduce_latency_s

    def _tp_layer_s(self, u: int, single_s: float, tokens: float) -> float:
        """A layer's time on unit ``u`` from its single-device time: work / t + 2 all-reduces of ``tokens`` x hidden."""
        t = self.unit_tp(u)
        if t == 1:
            return single_s
        dt = self._dtype(u)
        o = min(single_s, dt.layer_overhead_s * dt.speed_factor)  # the fixed part, slowed like the rest
        return (single_s - o) / t + o + 2 * self.allreduce_s(u, tokens * self.shape.hidden * 2)

    def capacity(self, dev: int) -> int:
        """Usable bytes of one device (of the unit's devices)."""
        return usable_bytes(self._dtype(dev))

    def layer_prefill_s(self, dev: int, bits: int, v: int, kappa: int = 1) -> float:
        """One layer's time for one prefill item: a micro-batch of ``v`` prompts, or one of its ``kappa`` chunks."""
        tp = self.unit_tp(dev)
        key = ("p", self._dtype(dev).name if tp == 1 else ("u", dev), bits, v, kappa)
        if key not in self._cache:
            lm = self.latency[self._dtype(dev).name]
            s = self.workload.prompt_len
            t = lm.prefill_s(bits, v, s) if kappa == 1 else lm.prefill_chunked_s(bits, v, s, kappa) / kappa
            t = self._tp_layer_s(dev, max(0.0, t), v * math.ceil(s / kappa))
            self._cache[key] = max(0.0, t)
        return self._cache[key]

    def layer_decode_s(self, dev: int, bits: int, v: int) -> float:
        tp = self.unit_tp(dev)
        key = ("d", self._dtype(dev).name if tp == 1 else ("u", dev), bits, v)
        if key not in self._cache:
            lm = self.latency[self._dtype(dev).name]
            t = max(0.0, lm.decode_s(bits, v, self.workload.mean_context))
            self._cache[key] = max(0.0, self._tp_layer_s(dev, t, v))
        return self._cache[key]

    def head_s(self, dev: int, v: int) -> float:
        """LM head of ``v`` tokens on the stage's first device (not split over a tensor-parallel group:
        conservative).

        The head measured with the device type's profile when its latency model has one (that model
        is already scaled by ``1 + slowdown``, ``planner.problem.latency_models``), else the catalog
        roofline times ``1 + slowdown``.
        """
        dt = self._dtype(dev)
        key = ("h", dt.name, v)
        if key not in self._cache:
            measured = self.latency[dt.name].head_s(v)
            if measured is None:
                self._cache[key] = lm_head_s(dt, self.shape, v) * dt.speed_factor
            else:
                self._cache[key] = max(0.0, measured)
        return self._cache[key]

    def driver_s(self, dev: int, v: int) -> float:
        """The engine's own work per decode micro-batch of ``v`` queries, done by the first stage's
        process beside its layers (measured by ``fleetbatch engine profile``; 0 when the profile lacks it)."""
        return self.latency[self._dtype(dev).name].driver_s(v)

    def link_bytes_per_s(self, src: int, dst: int) -> float:
        """Link between the first devices of two units."""
        return self.cluster.bandwidth_bytes_per_s(self._lead(src), self._lead(dst))

    def comm_prefill_s(self, src: int, dst: int, v: int) -> float:
        nbytes = v * self.workload.prompt_len * self.shape.hidden * 2
        return nbytes / self.link_bytes_per_s(src, dst)

    def comm_decode_s(self, src: int, dst: int, v: int) -> float:
        return v * self.shape.hidden * 2 / self.link_bytes_per_s(src, dst)

    def stage_constants(
        self, order: Sequence[int], k: int, v_p: int, v_d: int, kappa: int = 1
    ) -> tuple[float, float]:
        """Non-layer prefill (per item) and decode seconds of stage ``k``: receiving activations, LM head on the last."""
        cp = cd = 0.0
        if k > 0:
            cp += self.comm_prefill_s(order[k - 1], order[k], v_p) / kappa
            cd += self.comm_decode_s(order[k - 1], order[k], v_d)
        if k == len(order) - 1:
            cp += self.head_s(order[k], v_p)
            cd += self.head_s(order[k], v_d)
        return cp, cd

    def stage_memory_constant(self, n_stages: int, k: int, v_p: int, v_d: int, kappa: int = 1) -> int:
        """Bytes of stage ``k`` besides its layers: embeddings, LM head, activations."""
        key = ("m", n_stages == 1, k == 0, k == n_stages - 1, v_p, v_d, kappa)
        if key not in self._cache:
            self._cache[key] = self._stage_memory_constant(n_stages, k, v_p, v_d, kappa)
        return self._cache[key]

    def _stage_memory_constant(self, n_stages: int, k: int, v_p: int, v_d: int, kappa: int = 1) -> int:
        if self.weights_only:
            return 0
        m = self.memory
        first, last = k == 0, k == n_stages - 1
        total = m.activation_bytes(v_p, v_d, last, kappa)
        if first:
            total += m.embedding_bytes()
        if last:
            total += m.head_bytes(also_first=first)
        return total

    def stage_room(self, unit: int, n_stages: int, k: int, v_p: int, v_d: int, kappa: int = 1) -> int:
        """Bytes of layers (weights + KV, summed over the unit's devices) stage ``k`` on ``unit`` can hold.

        Every device of a tensor-parallel unit holds 1/t of the layers and a full copy of the stage
        constant, so t * (capacity - constant).
        """
        return self.unit_tp(unit) * (
            self.capacity(unit) - self.stage_memory_constant(n_stages, k, v_p, v_d, kappa)
        )

    def layer_bytes(self, bits: int) -> int:
        """Weights plus KV cache of one layer at ``bits`` (weights alone with ``weights_only``)."""
        key = ("w", bits)
        if key not in self._cache:
            kv = 0 if self.weights_only else self.memory.layer_kv_bytes()
            self._cache[key] = self.memory.layer_weight_bytes(bits) + kv
        return self._cache[key]

    def omega_norm(self, layer: int, bits: int) -> float:
        return self.omega[layer][bits] * self.omega_scale

    def evaluate(self, a: Assignment) -> Evaluation:
        if sum(a.stage_layers) != self.layers or len(a.bits) != self.layers:
            raise ValueError("assignment does not cover every layer exactly once")
        if any(n < 1 for n in a.stage_layers) or len(a.stage_layers) != len(a.order):
            raise ValueError("every device in the order must hold at least one layer")
        S = len(a.order)
        phys = [d for u in a.order for d in self.unit_devices(u)]
        if len(set(phys)) != len(phys):
            raise ValueError(f"order {a.order} uses a device twice")
        pre, dec, mem, cap = [], [], [], []
        for k, (lo, hi) in enumerate(a.layer_ranges()):
            dev = a.order[k]
            cp, cd = self.stage_constants(a.order, k, a.v_prefill, a.v_decode, a.kappa)
            pre.append(
                cp + sum(self.layer_prefill_s(dev, a.bits[i], a.v_prefill, a.kappa) for i in range(lo, hi))
            )
            dec.append(cd + sum(self.layer_decode_s(dev, a.bits[i], a.v_decode) for i in range(lo, hi)))
            mem.append(  # per device: the constant + 1/t of the layers
                self.stage_memory_constant(S, k, a.v_prefill, a.v_decode, a.kappa)
                + -(-sum(self.layer_bytes(a.bits[i]) for i in range(lo, hi)) // self.unit_tp(dev))
            )
            cap.append(self.capacity(dev))
        split = split_head(self, a, pre, dec, mem, cap) if self.head_split else 0.0
        m_p, m_d = self.micro_batches(a.v_prefill), self.micro_batches(a.v_decode)
        prefill = sum(pre) + (m_p * a.kappa - 1) * max(pre)
        decode = (self.workload.output_tokens - 1) * max(sum(dec), m_d * max(dec))
        omega = sum(self.omega[i][b] for i, b in enumerate(a.bits))
        objective = prefill + decode + self.workload.theta * omega * self.omega_scale
        tput = self.workload.batch * self.workload.output_tokens / (prefill + decode)
        return Evaluation(pre, dec, mem, cap, prefill, decode, omega, objective, tput, split)
