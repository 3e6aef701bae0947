"""``layout.png``: each cluster's planned layout, drawn next to a run's other plots (``fleetbatch loadgen report``).

One row per cluster: its stages side by side, each as wide as its layers, each layer coloured by
its bit width and each stage labelled with its device; the row's title gives the plan's
predicted and the run's measured tokens/s.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

BIT_COLOURS = {2: "#7f0000", 3: "#d7301f", 4: "#fc8d59", 8: "#fdcc8a", 16: "#9ecae1"}


def draw_layout(path: Path, rows: Mapping[str, dict]) -> str:
    """``rows``: cluster -> ``load.reports.layout.plan_rows`` row (devices, layers, bits, predicted/measured)."""
    fig, axes = plt.subplots(len(rows), 1, figsize=(7.2, 0.55 + 1.05 * len(rows)), squeeze=False)
    used: set[int] = set()
    for ax, (name, r) in zip(axes[:, 0], rows.items(), strict=True):
        for dev, (lo, hi), bits in zip(r["devices"], r["layers"], r["bits"], strict=True):
            for i, b in enumerate(bits):
                ax.barh(0, 1, left=lo + i, color=BIT_COLOURS.get(b, "#999999"), edgecolor="white")
                used.add(b)
            ax.barh(0, hi - lo, left=lo, fill=False, edgecolor="black", linewidth=1.5)
            ax.text((lo + hi) / 2, 0, dev, ha="center", va="center", fontsize=8)
        measured = r.get("measured_tokens_per_s")
        idle = f" ({', '.join(r['idle'])} idle)" if r.get("idle") else ""
        title = f"{name}{idle}: predicted {r['predicted_tokens_per_s']:.0f} tokens/s" + (
            f", measured {measured:.0f}" if measured else ""
        )
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_yticks([])
        ax.set_xlim(0, max(hi for _, hi in r["layers"]))
    axes[-1, 0].set_xlabel("decoder layer")
    handles = [Patch(color=BIT_COLOURS[b], label=f"{b}-bit") for b in sorted(used) if b in BIT_COLOURS]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
