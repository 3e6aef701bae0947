"""Submit a workload to the gateway over gRPC, stream its results, and summarise them."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

import grpc
from google.protobuf.json_format import MessageToDict
from tqdm import tqdm

from load.workload import WorkItem
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc


def to_request(
    items: Sequence[WorkItem], batch_id: str = "", metadata: dict | None = None
) -> pb.SubmitBatchRequest:
    req = pb.SubmitBatchRequest(batch_id=batch_id, metadata=metadata or {})
    for it in items:
        q = req.queries.add(id=it.id, prompt=it.prompt, max_tokens=it.max_tokens, metadata=it.metadata)
        q.sampling.temperature = it.temperature
        q.sampling.top_p = it.top_p
        if it.seed is not None:
            q.sampling.seed = int(it.seed)
        if it.forced_length is not None:
            q.forced_length = it.forced_length
    return req


def run_batch(
    target: str,
    items: Sequence[WorkItem],
    *,
    batch_id: str = "",
    progress: bool = True,
    timeout_s: float | None = None,
) -> tuple[pb.Batch, list[dict], float]:
    """Submit, stream every result until the batch is final; returns (batch, results, wall seconds)."""
    results: list[dict] = []
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 512 * 1024 * 1024)]) as ch:
        stub = pb_grpc.BatchServiceStub(ch)
        t0 = time.time()
        batch = stub.SubmitBatch(to_request(items, batch_id), timeout=600)
        bar = tqdm(total=len(items), desc=f"batch {batch.id[:8]}", unit="q", disable=not progress)
        stream = stub.StreamResults(
            pb.StreamResultsRequest(batch_id=batch.id, follow=True), timeout=timeout_s
        )
        for r in stream:
            results.append(
                MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
            )
            bar.update(1)
        bar.close()
        wall = time.time() - t0
        batch = stub.GetBatch(pb.GetBatchRequest(batch_id=batch.id), timeout=30)
    return batch, results, wall


def summarise(batch: pb.Batch, results: Sequence[dict], wall_s: float) -> dict:
    """Per-cluster and total figures of a finished batch."""
    per: dict[str, dict] = defaultdict(
        lambda: {"queries": 0, "completion_tokens": 0, "prompt_tokens": 0, "last_finish": 0.0}
    )
    first_enqueue = min((r["timings"]["enqueued_at"] for r in results if r.get("timings")), default=0.0)
    for r in results:
        c = per[r.get("cluster") or "-"]
        c["queries"] += 1
        c["completion_tokens"] += int(r.get("completion_tokens", 0))
        c["prompt_tokens"] += int(r.get("prompt_tokens", 0))
        c["last_finish"] = max(c["last_finish"], float(r["timings"].get("finished_at", 0)))
    clusters = {}
    for name, c in sorted(per.items()):
        clusters[name] = {
            "queries": c["queries"],
            "prompt_tokens": c["prompt_tokens"],
            "completion_tokens": c["completion_tokens"],
            "finished_after_s": round(c["last_finish"] - first_enqueue, 2) if first_enqueue else None,
        }
    total_tokens = sum(c["completion_tokens"] for c in per.values())
    reasons: dict[str, int] = defaultdict(int)
    for r in results:
        reasons[r.get("finish_reason", "")] += 1
    return {
        "batch_id": batch.id,
        "status": pb.BatchStatus.Name(batch.status).lower(),
        "queries": batch.request_counts.total,
        "completed": batch.request_counts.completed,
        "failed": batch.request_counts.failed,
        "cancelled": batch.request_counts.cancelled,
        "results": len(results),
        "duplicates": len(results) - len({r["query_id"] for r in results}),
        "wall_s": round(wall_s, 2),
        "completion_tokens": total_tokens,
        "tokens_per_s": round(total_tokens / wall_s, 1) if wall_s > 0 else 0.0,
        "finish_reasons": dict(reasons),
        "clusters": clusters,
    }


def format_summary(s: dict) -> str:
    lines = [
        f"batch {s['batch_id']}: {s['status']}, {s['completed']}/{s['queries']} completed, "
        f"{s['failed']} failed, {s['cancelled']} cancelled in {s['wall_s']} s "
        f"({s['completion_tokens']} tokens, {s['tokens_per_s']} tokens/s)",
        f"{'cluster':<12} {'queries':>8} {'prompt tok':>11} {'output tok':>11} {'done after s':>13}",
    ]
    for name, c in s["clusters"].items():
        lines.append(
            f"{name:<12} {c['queries']:>8} {c['prompt_tokens']:>11} {c['completion_tokens']:>11} {c['finished_after_s'] or 0:>13.1f}"
        )
    return "\n".join(lines)
