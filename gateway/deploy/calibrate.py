"""``fleetbatch gateway calibrate``: show the length calibration of each served model, or teach it from answers.

The gateway calibrates its length estimates from what the workers observed (:mod:`gateway.assign.calibrated`):
a deployment's first batch of a new model runs on the predictor's own estimates. A user who has answers of
the model already (an earlier run's output, a sample run beforehand) can teach it first: ``--answers FILE``
reads JSONL rows with a ``prompt`` and its answer's length in the served model's tokens (``length``, as
``fleetbatch predictor export`` writes, or ``completion_tokens``, as the results and ``usage`` carry), predicts
each prompt with the gateway's predictor and adds the pairs to the model's statistics, as a worker adds the
pairs it observes. ``--reset`` forgets a model's statistics.

``--distribution FILE`` writes the model's observed answer lengths (per range of the estimate: the mean
observed length and the share of answers) as ``{"buckets": [[lo, hi, p], ...]}``, the file
``fleetbatch planner plan --length-distribution`` reads: the planner's workload in the served model's lengths.

Without ``--answers`` it prints, for each length model the clusters registered (or ``--length-model``), its
observations, overall ratio and, per range of the raw estimate, the answers seen and the calibrated value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from predictor.calibration import Calibration
from workqueue import Observation, WorkQueue, connect, keys
from workqueue.length_stats import N_RANGES, RANGE_EDGES, read_stats


def add_arguments(p) -> None:
    p.add_argument(
        "--redis-url", required=True, help="the deployment's Redis (fleetbatch gateway up: gateway.json)"
    )
    p.add_argument(
        "--length-model",
        action="append",
        default=[],
        metavar="KEY",
        help="the served model's key (what `fleetbatch engine serve --length-model` registered; default: "
        "every key the clusters registered; with --answers exactly one is needed, or --cluster)",
    )
    p.add_argument("--cluster", default=None, help="the length model of this cluster")
    p.add_argument(
        "--answers",
        default=None,
        metavar="FILE",
        help="JSONL of the served model's answers: 'prompt' and 'length' or 'completion_tokens' per line",
    )
    p.add_argument(
        "--predictor",
        default="shipped",
        help="the gateway's length predictor, whose raw estimates the answers are compared with (default shipped)",
    )
    p.add_argument("--reset", action="store_true", help="forget the model's statistics first")
    p.add_argument(
        "--distribution",
        default=None,
        metavar="FILE",
        help="write the model's observed answer lengths, by range, as the planner's --length-distribution file",
    )


def cluster_models(queue: WorkQueue, names: list[str] | None = None) -> dict[str, str]:
    """Each cluster (of ``names``, or every one) that registered a length model, and that model."""
    names = queue.cluster_names() if names is None else names
    models = {n: queue.r.hget(keys.cluster_info(n), "length_model") for n in names}
    return {n: m for n, m in models.items() if m}


def registered_models(queue: WorkQueue, cluster: str | None = None) -> list[str]:
    """The length models the clusters (or ``cluster``) registered."""
    models = cluster_models(queue, [cluster] if cluster else None)
    if cluster and not models:
        raise ValueError(f"cluster {cluster!r} has registered no length model (is its engine running?)")
    return sorted(set(models.values()))


def read_answers(path: str | Path) -> tuple[list[str], list[int]]:
    """Prompts and answer lengths of a JSONL file; a line without them is an error naming it."""
    prompts, lengths = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                length = row["length"] if "length" in row else row["completion_tokens"]
                if not isinstance(row["prompt"], str) or int(length) < 0:
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"{path} line {n}: expected a JSON object with 'prompt' and 'length' or 'completion_tokens'"
                ) from None
            prompts.append(row["prompt"])
            lengths.append(int(length))
    if not prompts:
        raise ValueError(f"{path} has no answers")
    return prompts, lengths


def teach(
    queue: WorkQueue, model: str, prompts: Sequence[str], lengths: Sequence[int], raw: Sequence[float]
) -> None:
    """Add the pairs (``raw`` estimate, observed length) to ``model``'s statistics, as workers add theirs."""
    rows = [
        Observation(p, int(n), predicted=float(e), retrain=False)
        for p, n, e in zip(prompts, lengths, raw, strict=True)
    ]
    for start in range(0, len(rows), 1000):
        queue.record_observed(rows[start : start + 1000], length_model=model)


def table(model: str, queue: WorkQueue) -> dict:
    """One model's calibration, as the command prints it."""
    stats = read_stats(queue.r, model)
    cal = Calibration.from_stats(stats)
    ranges = []
    for i in range(N_RANGES):
        if stats.n[i]:
            mean_raw = stats.raw[i] / stats.n[i]
            ranges.append(
                {
                    "raw_from": RANGE_EDGES[i - 1] if i else 0,
                    "raw_to": RANGE_EDGES[i] if i < len(RANGE_EDGES) else None,
                    "answers": int(stats.n[i]),
                    "mean_raw": round(mean_raw, 1),
                    "mean_observed": round(stats.observed[i] / stats.n[i], 1),
                    "calibrated": round(float(cal.apply([mean_raw])[0]), 1),
                }
            )
    return {
        "length_model": model,
        "observations": int(stats.count),
        "ratio": round(cal.ratio, 4),
        "ranges": ranges,
    }


def write_distribution(path: str | Path, shown: dict) -> None:
    """The observed lengths of :func:`table`'s ranges as the planner's length distribution."""
    total = sum(r["answers"] for r in shown["ranges"])
    if not total:
        raise ValueError(f"length model {shown['length_model']} has no observed answers yet")
    buckets = [[r["mean_observed"], r["mean_observed"], r["answers"] / total] for r in shown["ranges"]]
    Path(path).write_text(json.dumps({"length_model": shown["length_model"], "buckets": buckets}) + "\n")


def run(args) -> dict:
    queue = WorkQueue(connect(args.redis_url))
    models = args.length_model or registered_models(queue, args.cluster)
    if args.answers or args.reset:
        if len(models) != 1:
            raise ValueError(
                f"name one length model to teach or reset (--length-model or --cluster); registered: "
                f"{', '.join(models) or 'none'}"
            )
        if args.reset:
            queue.r.delete(keys.length_stats(models[0]))
        if args.answers:
            from predictor.serving import LengthPredictor  # torch: only when answers are taught

            prompts, lengths = read_answers(args.answers)
            predictor = LengthPredictor.from_dir(args.predictor)
            teach(queue, models[0], prompts, lengths, [p.expected_tokens for p in predictor.predict(prompts)])
    out = {"models": [table(m, queue) for m in models]}
    if args.distribution:
        if len(models) != 1:
            raise ValueError("--distribution: name one length model (--length-model or --cluster)")
        write_distribution(args.distribution, out["models"][0])
    for t in out["models"]:
        print(f"{t['length_model']}: x{t['ratio']:.3f} from {t['observations']} answers")
        for r in t["ranges"]:
            print(
                f"  raw {r['raw_from']:>6}-{r['raw_to'] or '':<6} {r['answers']:>6} answers  mean raw "
                f"{r['mean_raw']:>7.1f}  observed {r['mean_observed']:>7.1f}  calibrated {r['calibrated']:>7.1f}"
            )
    return out
