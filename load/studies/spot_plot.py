"""The spot benchmark's plot: each run's cost per cluster over the run (the gateway's cost meter), each cluster's
last finish marked, the preemptions and the hard kill as vertical lines."""

from __future__ import annotations

from pathlib import Path

COLOURS = {"fast": "tab:blue", "medium": "tab:orange", "slow": "tab:green"}


def plot(runs: dict[str, dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(runs))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(runs) :]:
        ax.axis("off")
    for ax, (name, run) in zip(axes.flat, runs.items(), strict=False):
        meta, costs = run["meta"], run["costs"]
        t0 = meta["created_at"]
        for cluster in sorted({c for row in costs for c in row["clusters"]}):
            xs = [row["t"] - t0 for row in costs]
            ys = [row["clusters"].get(cluster, 0.0) for row in costs]
            colour = COLOURS.get(cluster)
            ax.plot(xs, ys, label=cluster, color=colour)
            done = [
                float(r["timings"]["finished_at"]) - t0 for r in run["rows"] if r.get("cluster") == cluster
            ]
            if done:
                ax.axvline(max(done), color=colour, linestyle=":", linewidth=1)
        for e in meta["events"]:
            ax.axvline(e["t"] - t0, color="red" if e["kind"] == "kill" else "grey", linewidth=0.8, alpha=0.6)
        ax.set_title(f"{name}: {meta['cost_dollars']:.4f} $", fontsize=9)
        ax.set_xlabel("seconds from submission")
    axes[0][0].set_ylabel("cost so far, $")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("cost per cluster (dotted: its last finish; grey: notices; red: the hard kill)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
