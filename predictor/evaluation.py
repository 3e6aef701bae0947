"""Evaluation figures: bucket accuracy (and within one bucket, and the majority guess), Kendall tau
and MAE of expected tokens, batch-sum calibration, per-source figures, and the confusion matrix plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau

from predictor.buckets import Buckets


def tau(pred: np.ndarray, true: np.ndarray) -> float:
    """Kendall tau-b (0.0 where undefined, e.g. constant predictions)."""
    if len(pred) < 2:
        return 0.0
    t = kendalltau(pred, true).statistic
    return 0.0 if np.isnan(t) else float(t)


def batch_sum_error(
    pred: np.ndarray, true: np.ndarray, batch: int = 64, seed: int = 0, rounds: int = 200
) -> float:
    """Mean |sum(pred) - sum(true)| / sum(true) over random batches of ``batch`` queries."""
    n = len(true)
    if n == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    errs = []
    for _ in range(rounds):
        idx = rng.choice(n, size=min(batch, n), replace=False)
        s = true[idx].sum()
        if s > 0:
            errs.append(abs(pred[idx].sum() - s) / s)
    return float(np.mean(errs)) if errs else float("nan")


def point_figures(pred: np.ndarray, true: np.ndarray) -> dict:
    """Ranking and error figures of a point estimate of tokens."""
    true = np.asarray(true, dtype=np.float64)
    pred = np.asarray(pred, dtype=np.float64)
    return {
        "kendall_tau": tau(pred, true),
        "mae_tokens": float(np.mean(np.abs(pred - true))) if len(true) else float("nan"),
        "sum_ratio": float(pred.sum() / true.sum()) if true.sum() > 0 else float("nan"),
        "batch64_sum_error": batch_sum_error(pred, true, 64),
    }


def classifier_figures(
    probs: np.ndarray, lengths: np.ndarray, buckets: Buckets, train_labels: np.ndarray | None = None
) -> dict:
    """Bucket figures plus point figures of the expectation and of the argmax midpoint."""
    lengths = np.asarray(lengths, dtype=np.float64)
    y = buckets.label(lengths)
    pred = probs.argmax(1)
    majority_ref = np.asarray(train_labels) if train_labels is not None and len(train_labels) else y
    majority = int(np.bincount(majority_ref, minlength=buckets.n).argmax())
    expected = buckets.expected(probs)
    midpoint = buckets.midpoint(pred)
    out = {
        "n": int(len(y)),
        "accuracy": float(np.mean(pred == y)) if len(y) else float("nan"),
        "within_one": float(np.mean(np.abs(pred - y) <= 1)) if len(y) else float("nan"),
        "majority_accuracy": float(np.mean(y == majority)) if len(y) else float("nan"),
    }
    out.update(point_figures(expected, lengths))
    mid = point_figures(midpoint, lengths)
    out.update({f"midpoint_{k}": v for k, v in mid.items()})
    return out


def per_source(
    probs: np.ndarray,
    lengths: np.ndarray,
    sources: Sequence[str],
    buckets: Buckets,
    train_labels: np.ndarray | None = None,
) -> dict[str, dict]:
    src = np.asarray(sources)
    return {
        s: classifier_figures(probs[src == s], np.asarray(lengths)[src == s], buckets, train_labels)
        for s in sorted(set(src.tolist()))
    }


def confusion(y_true: np.ndarray, y_pred: np.ndarray, n: int) -> np.ndarray:
    m = np.zeros((n, n), dtype=np.int64)
    np.add.at(m, (np.asarray(y_true), np.asarray(y_pred)), 1)
    return m


def plot_confusion(matrix: np.ndarray, buckets: Buckets, path: str | Path, title: str = "") -> Path:
    """Row-normalised confusion matrix as a PNG (rows: true bucket, columns: predicted bucket)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = matrix.sum(1, keepdims=True).clip(min=1)
    norm = matrix / rows
    labels = [f"{int(a)}-{int(b)}" for a, b in zip(buckets.edges[:-1], buckets.edges[1:], strict=True)]
    fig, ax = plt.subplots(figsize=(1.0 + 0.6 * buckets.n, 0.8 + 0.55 * buckets.n))
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    for i in range(buckets.n):
        for j in range(buckets.n):
            if matrix[i, j]:
                ax.text(
                    j,
                    i,
                    str(matrix[i, j]),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if norm[i, j] > 0.5 else "black",
                )
    ax.set_xticks(range(buckets.n), labels, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(buckets.n), labels, fontsize=7)
    ax.set_xlabel("predicted bucket (tokens)")
    ax.set_ylabel("true bucket (tokens)")
    ax.set_title(title or f"{buckets.scheme} buckets, row-normalised", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
