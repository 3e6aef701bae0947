"""The tables ``fleetbatch gateway status`` and ``rebalance`` print: clusters (liveness, capacity, queue, expected finish) and
batches (rows and tokens done, ETA against the deadline)."""

from __future__ import annotations


def batch_table(batches, now: float) -> str:
    """Batches' progress: rows done, tokens done of predicted, ETA and deadline in seconds from ``now``."""
    lines = [
        f"{'batch':<34} {'status':<12} {'rows':>11} {'tokens':>7} {'ETA s':>8} {'deadline s':>10} {'cost $':>9} at risk"
    ]
    for b in batches:
        c = b.request_counts
        rows = f"{c.completed + c.failed + c.cancelled}/{c.total}"
        tokens = f"{100 * b.done_predicted_tokens / b.predicted_tokens:.0f}%" if b.predicted_tokens else "-"
        eta = f"{b.predicted_finish_at - now:.0f}" if b.predicted_finish_at else "-"
        deadline = f"{b.deadline - now:.0f}" if b.deadline else "-"
        status = pb_status_name(b.status)
        lines.append(
            f"{b.id:<34} {status:<12} {rows:>11} {tokens:>7} {eta:>8} {deadline:>10} {b.cost_dollars:>9.4f} "
            f"{'yes' if b.at_risk else 'no'}"
        )
    return "\n".join(lines)


def pb_status_name(status: int) -> str:
    from protos import fleetbatch_pb2 as pb

    return pb.BatchStatus.Name(status).lower()


def cluster_table(clusters) -> str:
    lines = [
        f"{'cluster':<12} {'alive':<5} {'state':<9} {'cap tok/s':>9} {'queue':>6} {'running':>7} "
        f"{'pending tok':>11} {'finish s':>8} {'done':>6} {'tokens':>8} {'$/h':>7} {'cost $':>9}"
    ]
    for c in clusters:
        lines.append(
            f"{c.name:<12} {'yes' if c.alive else 'no':<5} {c.state:<9} {c.capacity_tokens_per_s:>9.1f} "
            f"{c.queue_length:>6} {c.running:>7} {c.pending_predicted_tokens:>11.0f} {c.expected_finish_s:>8.1f} "
            f"{c.finished_queries:>6} {c.finished_actual_tokens:>8} "
            f"{f'{c.price_per_hour:.2f}' + ('' if c.billed else '*') if c.price_per_hour else '-':>7} "
            f"{c.cost_dollars:>9.4f}"
        )
    return "\n".join(lines)


def cost_line(resp) -> str:
    """The fleet's cost rate and cost so far (a ``ListClustersResponse``), under the cluster table."""
    return (
        f"fleet cost: {resp.cost_per_hour:.2f} $/h now, {resp.cost_dollars:.4f} $ so far "
        "(* released: holds no work, billed nothing now)"
    )
