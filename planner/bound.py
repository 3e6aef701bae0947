"""A lower bound on the batch latency of *any* pipeline-parallel plan under the cost model.

Used by ``fleetbatch planner compare`` to say how far a speedup over the baselines could go at all. It
relaxes the plan: every device of the cluster may be a stage, layers may be split fractionally,
each layer takes the fastest allowed bit width on its device (allowed: a bit width some layer
can take without its omega alone exceeding the cap), memory counts only weights + KV at the
smallest allowed width against each device's usable bytes less the smallest stage constant,
and links and the LM head cost nothing. With ``T`` the smallest bottleneck (max over stages)
such a split can reach and ``Sigma`` the smallest sum of stage times (layers on the fastest
devices first):

    prefill >= Sigma_p + (m_p * kappa - 1) * T_p        (min over the candidate v_p, kappa)
    decode  >= (n - 1) * max(Sigma_d, m_d * T_d)         (min over the candidate v_d)

No plan the search can return is faster; a speedup over a baseline of latency ``T_base`` is at
most ``T_base / bound``. With tensor parallelism the same relaxation runs on the stage units of
every grouping of ``planner.search.tp_groupings`` (a TP group is one "device" with t times the
layer room and its TP layer times) and the smallest is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from planner.costs import Problem
from planner.search import tp_groupings


def _bottleneck(times: list[float], caps: list[float], layers: int) -> float:
    """Smallest T with sum_d min(cap_d, T / t_d) >= layers (fractional layers); inf if memory is short."""
    if sum(caps) < layers:
        return float("inf")
    lo, hi = 0.0, max(t * layers for t in times)
    for _ in range(80):
        mid = (lo + hi) / 2
        if sum(min(c, mid / t) if t > 0 else c for t, c in zip(times, caps, strict=True)) >= layers:
            hi = mid
        else:
            lo = mid
    return hi


def _fastest_sum(times: list[float], caps: list[float], layers: int) -> float:
    left, total = float(layers), 0.0
    for t, c in sorted(zip(times, caps, strict=True)):
        take = min(c, left)
        total += take * t
        left -= take
        if left <= 0:
            break
    return total if left <= 1e-9 else float("inf")


def pipeline_latency_bound(
    problem: Problem,
    omega_cap: float | None,
    micro_batches: list[tuple[int, int]],
    kappas: list[int],
    tp_sizes: Sequence[int] = (1,),
) -> float:
    """Lower bound on any plan's batch latency; with ``tp_sizes`` beyond (1,), over every plan whose
    stages are tensor-parallel groups of those sizes (the smallest bound over the groupings)."""
    return min(
        _bound_units(problem, omega_cap, micro_batches, kappas, units)
        for units in tp_groupings(problem, tp_sizes)
    )


def _bound_units(
    problem: Problem,
    omega_cap: float | None,
    micro_batches: list[tuple[int, int]],
    kappas: list[int],
    units: tuple[int, ...],
) -> float:
    L, wl = problem.layers, problem.workload
    devs = units
    bits = [
        b
        for b in problem.bits
        if omega_cap is None or min(problem.omega[i][b] for i in range(L)) <= omega_cap * (1 + 1e-12)
    ]
    if not bits:
        return float("inf")
    n_dev = len(units)
    S = max(n_dev, 3)
    kmax = max(kappas)
    const = min(problem.stage_memory_constant(S, k, 1, 1, kmax) for k in range(S))
    per_layer = min(problem.layer_bytes(b) for b in bits)
    caps = [max(0.0, problem.unit_tp(d) * (problem.capacity(d) - const) / per_layer) for d in devs]

    def phase(t_of: Callable[[int, int], float]) -> tuple[float, float]:
        t = [min(t_of(d, b) for b in bits) for d in devs]
        return _bottleneck(t, caps, L), _fastest_sum(t, caps, L)

    pre = float("inf")
    for vp in sorted({p for p, _ in micro_batches}):
        for k in kappas:
            T, sig = phase(lambda d, b: problem.layer_prefill_s(d, b, vp, k))  # noqa: B023
            pre = min(pre, sig + (problem.micro_batches(vp) * k - 1) * T)
    dec = float("inf")
    for vd in sorted({d for _, d in micro_batches}):
        T, sig = phase(lambda d, b: problem.layer_decode_s(d, b, vd))  # noqa: B023
        dec = min(dec, max(sig, problem.micro_batches(vd) * T))
    return pre + (wl.output_tokens - 1) * dec
