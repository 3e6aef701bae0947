"""The planned layout of each cluster next to what it measured (``fleetbatch loadgen demo``, ``fleetbatch loadgen report``).

``fleetbatch gateway up`` with a fleet records in ``gateway.json`` (``layouts``) the plan each cluster runs:
devices, layer split, bits per layer, micro-batch sizes, predicted tokens/s. After a batch, a
cluster's measured tokens/s is what it sustained: in a run report, the median of the engine's own
tokens/s over the samples where work waited in its queue (no ramp, no tail); in ``loadgen``'s
summary, its output tokens over the time from the batch's first enqueue to its last finish.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.deploy.fleet_up import describe_layout, idle_devices
from load.workload import WorkItem


def mean_lengths(items: Sequence[WorkItem]) -> tuple[int, int]:
    """Mean prompt tokens (by the served tokenizer) and mean response tokens (forced, else the cap) of
    ``items``: the lengths a fleet is planned for (``fleetbatch gateway up --fleet-lengths``)."""
    from localmodels import default_tokenizer  # lazy: transformers

    tok = default_tokenizer()
    prompt = sum(len(tok(i.prompt)["input_ids"]) for i in items) / len(items)
    output = sum(i.forced_length or i.max_tokens for i in items) / len(items)
    return max(1, round(prompt)), max(1, round(output))


def measured_tps(cluster: Mapping) -> float | None:
    """What a cluster sustained: the engine's own rate while work waited (a run report's ``saturated_tps``),
    else its output tokens over its time to its last finish (``loadgen``'s summary)."""
    if cluster.get("saturated_tps"):
        return float(cluster["saturated_tps"])
    done = cluster.get("finished_after_s")
    tokens = cluster.get("completion_tokens", cluster.get("actual_tokens"))
    return tokens / done if done and tokens is not None else None


def plan_rows(layouts: Mapping[str, dict], summary: Mapping) -> dict[str, dict]:
    """Per cluster: the plan's predicted and the run's measured tokens/s, and their relative error."""
    out = {}
    for name, row in layouts.items():
        c = summary.get("clusters", {}).get(name)
        measured = measured_tps(c) if c else None
        predicted = float(row["predicted_tokens_per_s"])
        out[name] = {
            "stages": len(row["devices"]),
            "devices": row["devices"],
            "idle": idle_devices(row),
            "layers": row["layers"],
            "bits": row["bits"],
            "predicted_tokens_per_s": round(predicted, 1),
            "measured_tokens_per_s": round(measured, 1) if measured else None,
            "error": round(abs(measured - predicted) / measured, 3) if measured else None,
        }
    return out


def format_layouts(layouts: Mapping[str, dict], rows: Mapping[str, dict] | None = None) -> str:
    """The layout of every cluster, one line each, with predicted against measured tokens/s if known."""
    lines = []
    for name, row in layouts.items():
        line = describe_layout(name, row, row.get("fleet_devices"))
        r = (rows or {}).get(name)
        if r and r["measured_tokens_per_s"]:
            line += f", measured {r['measured_tokens_per_s']:.0f} ({r['error']:.0%} off)"
        lines.append(line)
    return "\n".join(lines)
