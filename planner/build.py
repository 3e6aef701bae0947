"""Turn a search result (an assignment and its evaluation) into a ``Plan`` for ``plan.json``."""

from __future__ import annotations

from planfile import Plan, StagePlan
from planner.costs import Assignment, Evaluation, Problem


def make_plan(problem: Problem, a: Assignment, e: Evaluation, method: str, solve_seconds: float) -> Plan:
    devs = problem.cluster.devices
    # the first device of every stage, in stage order (device_index = k, as without tensor
    # parallelism), then the other devices of tensor-parallel stages; unused devices are left out
    groups = [problem.unit_devices(u) for u in a.order]
    listed = [g[0] for g in groups] + [i for g in groups for i in g[1:]]
    devices = [
        {
            "name": devs[i].name,
            "type": devs[i].type.name,
            "memory_bytes": devs[i].type.memory_bytes,
            "node": devs[i].node,
            "slowdown": float(devs[i].type.slowdown),
        }
        for i in listed
    ]
    tp_idx: list[list[int] | None] = []
    for k, g in enumerate(groups):
        tp_idx.append([k] + [listed.index(i) for i in g[1:]] if len(g) > 1 else None)
    stages = [
        StagePlan(
            device_index=k,
            layer_start=lo,
            layer_end=hi,
            bits=list(a.bits[lo:hi]),
            predicted_memory_bytes=int(e.stage_memory_bytes[k]),
            predicted_prefill_s=float(e.stage_prefill_s[k]),
            predicted_decode_s=float(e.stage_decode_s[k]),
            tp_device_indices=tp_idx[k],
        )
        for k, (lo, hi) in enumerate(a.layer_ranges())
    ]
    w = problem.workload
    model = problem.shape.essentials()
    return Plan(
        model={
            k: model[k]
            for k in ("name", "family", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")
        },
        method=method,
        devices=devices,
        stages=stages,
        kv_bits=w.kv_bits,
        prefill_micro_batch=a.v_prefill,
        decode_micro_batch=a.v_decode,
        batch_size=w.batch,
        prompt_len=w.prompt_len,
        expected_output_tokens=w.output_tokens,
        theta=w.theta,
        total_omega=float(e.omega),
        predicted_batch_latency_s=float(e.latency_s),
        predicted_throughput_tokens_per_s=float(e.throughput),
        solve_seconds=float(solve_seconds),
        head_split=round(float(e.head_split), 4),
        extra={
            "cluster": problem.cluster.name,
            "predicted_prefill_s": float(e.prefill_s),
            "predicted_decode_s": float(e.decode_s),
            "objective": float(e.objective),
            "prefill_chunks": a.kappa,
            "tensor_parallel": [len(g) for g in groups],
            "prefill_chunk_tokens": -(-w.prompt_len // a.kappa),
            "throughput_counts": "generated tokens per second",
        },
    )
