"""``fleetbatch loadgen wan``'s plot: each cluster's device-busy fraction, and the makespan against 0 ms, by round-trip time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOT = "utilization_vs_rtt.png"


def draw(summary: dict, out_dir: Path, title: str = "") -> Path:
    """Write :data:`PLOT` into ``out_dir`` from :func:`load.studies.wan_stats.summarise`'s summary."""
    rtts = sorted(summary["makespan_by_rtt_ms"], key=float)
    x = [float(r) for r in rtts]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for name, by_rtt in summary["utilization_by_cluster"].items():
        pts = [(float(r), by_rtt[r]) for r in rtts if by_rtt.get(r) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"{name} busy")
    mean = [(float(r), summary["utilization_by_rtt_ms"][r]) for r in rtts]
    mean = [p for p in mean if p[1] is not None]
    if mean:
        ax.plot(*zip(*mean, strict=True), color="black", linestyle="--", marker="s", label="mean busy")
    ax.set_xlabel("round-trip time engine <-> Redis (ms)")
    ax.set_ylabel("device-busy fraction of the cluster's span")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    ratio = [(float(r), summary["makespan_ratio_by_rtt_ms"][r]) for r in rtts]
    ratio = [p for p in ratio if p[1] is not None]
    lines, labels = ax.get_legend_handles_labels()
    if ratio:
        ax2 = ax.twinx()
        ax2.plot(*zip(*ratio, strict=True), color="tab:red", marker="^", label="makespan / makespan at 0 ms")
        top = max(1.2, max(v for _, v in ratio) * 1.05)
        ax2.set_ylim(min(0.9, min(v for _, v in ratio) * 0.95), top)
        ax2.set_ylabel("makespan / makespan at 0 ms", color="tab:red")
        more = ax2.get_legend_handles_labels()
        lines, labels = lines + more[0], labels + more[1]
    ax.legend(lines, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8)
    ax.set_title(title or "device-busy fraction and makespan against the engines' round trip to Redis")
    fig.tight_layout()
    path = Path(out_dir) / PLOT
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend sits below the axes
    plt.close(fig)
    return path
