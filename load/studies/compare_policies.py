"""`fleetbatch loadgen compare-policies`: assignment policies side by side on real response lengths.

The workload is the mixed workload of issue [2/9] (``fleetdata.datasets.load_mixed``), in
tokens of the serving tokenizer (``localmodels.default_tokenizer``). A seeded batch of
``-n`` queries is drawn; each query's expected response length comes from the serving
predictor (``--predictor DIR``) or, when that is absent, from a TF-IDF + ridge model on
log length fitted here on a disjoint training split (the output JSON says which). Every
policy assigns the batch from the *predicted* lengths; the simulation then charges each
cluster the *actual* prompt + recorded-response tokens it got:

* 3 equal clusters: ``imbalance = max / mean`` of actual tokens per cluster;
* 3 clusters with capacities 1:2:4: ``expected makespan = max_c tokens_c / capacity_c``,
  and ``makespan_ratio_unequal`` = capacity-weighted ``token`` over ``round_robin``.

Also reported: per-policy figures, the same imbalance for small batches (MICO's regime),
an oracle (``token`` fed the actual lengths), predictor quality and the time to assign a
100,000-query batch. The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cliutil import run_main
from fleetdata.datasets import load_mixed, response_lengths
from gateway.assign.estimates import tokens_per_cluster
from gateway.assign.policies import ClusterView, QueryLoad
from gateway.assign.registry import POLICIES, make_policy
from predictor.labeled import split_of

POLICY_ORDER = ("round_robin", "least_loaded", "token_equal", "token")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir", default=None, help="dataset directory (default $FLEETBATCH_DATA or ../shared/data)"
    )
    parser.add_argument("-n", "--num-queries", type=int, default=3000, help="queries in the batch (default 3000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--predictor", default=None, help="trained predictor directory (predictor.serving)")
    parser.add_argument(
        "--train-max", type=int, default=6000, help="training records for the fallback predictor"
    )
    parser.add_argument(
        "--capacities", default="1,2,4", help="capacities of the unequal clusters (default 1,2,4)"
    )
    parser.add_argument("--num-clusters", type=int, default=3, help="number of equal clusters (default 3)")
    parser.add_argument(
        "--small-batch", type=int, default=200, help="batch size of the small-batch imbalance figure"
    )
    parser.add_argument(
        "--timing-n", type=int, default=100_000, help="queries of the assignment-time figure (0: skip)"
    )
    parser.add_argument("--plot", default=None, help="write a PNG of per-cluster tokens per policy")


def _parse_capacities(text: str) -> list[float]:
    try:
        caps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--capacities must be comma-separated numbers, not {text!r}") from None
    if len(caps) < 2 or any(not (c > 0 and math.isfinite(c)) for c in caps):
        raise ValueError(f"--capacities needs at least two positive numbers, not {text!r}")
    return caps


def _validate(args: argparse.Namespace) -> None:
    if args.num_queries < 10:
        raise ValueError(f"-n must be at least 10, not {args.num_queries}")
    if args.num_clusters < 2:
        raise ValueError(f"--num-clusters must be at least 2, not {args.num_clusters}")
    if args.train_max < 100:
        raise ValueError(f"--train-max must be at least 100, not {args.train_max}")
    if args.small_batch < args.num_clusters:
        raise ValueError(
            f"--small-batch must be at least --num-clusters ({args.num_clusters}), not {args.small_batch}"
        )


def fit_fallback_predictor(prompts: Sequence[str], lengths: Sequence[int], seed: int):
    """TF-IDF (word 1-2 grams) + ridge on log(1 + length); returns ``predict(prompts) -> np.ndarray`` of means.

    The log-space prediction is turned into an expected length with Duan's smearing factor,
    estimated on a held-out fifth of the training records.
    """
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import Ridge

    y = np.log1p(np.asarray(lengths, dtype=np.float64))
    idx = np.random.default_rng(seed).permutation(len(prompts))
    cut = max(1, len(idx) // 5)
    hold, fit = idx[:cut], idx[cut:]
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, max_features=50_000, sublinear_tf=True)
    x_fit = vec.fit_transform([prompts[i] for i in fit])
    model = Ridge(alpha=1.0).fit(x_fit, y[fit])
    resid = y[hold] - model.predict(vec.transform([prompts[i] for i in hold]))
    smear = float(np.mean(np.exp(resid)))

    def predict(batch: Sequence[str]) -> np.ndarray:
        return np.maximum(0.0, np.exp(model.predict(vec.transform(list(batch)))) * smear - 1.0)

    return predict


def _serving_predictor(model_dir: str):
    from predictor.serving import LengthPredictor  # lazy: torch, transformers (loadgen starts without)

    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"predictor directory {model_dir} not found")
    lp = LengthPredictor.from_dir(model_dir)

    def predict(batch: Sequence[str]) -> np.ndarray:
        return np.asarray([p.expected_tokens for p in lp.predict(list(batch))], dtype=np.float64)

    return predict


def simulate(
    policy_name: str,
    queries: Sequence[QueryLoad],
    actual_total: Sequence[float],
    clusters: Sequence[ClusterView],
) -> dict:
    """Assign ``queries`` with a fresh policy; per-cluster actual and predicted tokens, imbalance, makespan."""
    assignment = make_policy(policy_name).assign(queries, clusters)
    actual = tokens_per_cluster(queries, assignment, actual_total)
    predicted = tokens_per_cluster(queries, assignment)
    names = [c.name for c in clusters]
    act = [actual.get(n, 0.0) for n in names]
    pred = [predicted.get(n, 0.0) for n in names]
    counts = [sum(1 for a in assignment if a == n) for n in names]
    finish = [a / c.capacity_tps for a, c in zip(act, clusters, strict=True)]
    return {
        "actual_tokens": [round(a) for a in act],
        "predicted_tokens": [round(p) for p in pred],
        "queries": counts,
        "imbalance": max(act) / (sum(act) / len(act)),
        "imbalance_predicted": max(pred) / (sum(pred) / len(pred)),
        "makespan": max(finish),
        "makespan_predicted": max(p / c.capacity_tps for p, c in zip(pred, clusters, strict=True)),
    }


def _small_batch_imbalance(policy_name, queries, actual_total, clusters, size) -> float:
    values = []
    for start in range(0, len(queries) - size + 1, size):
        values.append(
            simulate(
                policy_name, queries[start : start + size], actual_total[start : start + size], clusters
            )["imbalance"]
        )
    return float(np.mean(values))


def _assign_seconds(n: int, k: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(5, 400, n)
    preds = rng.lognormal(4.0, 1.0, n)
    queries = [
        QueryLoad(str(i), int(p), float(r)) for i, (p, r) in enumerate(zip(prompts, preds, strict=True))
    ]
    clusters = [ClusterView(f"c{i}", float(1 + i % 4), pending_tokens=float(1000 * i)) for i in range(k)]
    t0 = time.perf_counter()
    make_policy("token").assign(queries, clusters)
    return time.perf_counter() - t0


def _plot(path: str, equal: dict, unequal: dict, caps: Sequence[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, results, title, key, scale in (
        (axes[0], equal, "equal clusters: actual tokens per cluster", "actual_tokens", None),
        (
            axes[1],
            unequal,
            f"capacities {':'.join(f'{c:g}' for c in caps)}: tokens / capacity",
            "actual_tokens",
            caps,
        ),
    ):
        names = list(results)
        k = len(results[names[0]][key])
        width = 0.8 / k
        for c in range(k):
            vals = [results[n][key][c] / (scale[c] if scale else 1.0) for n in names]
            ax.bar(np.arange(len(names)) + c * width - 0.4 + width / 2, vals, width, label=f"cluster {c}")
        ax.set_xticks(np.arange(len(names)), names, rotation=15)
        ax.set_title(title)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    """Run the comparison; returns the figures (the CLI prints them as the last line)."""
    from localmodels import default_tokenizer  # lazy: transformers (loadgen starts without)

    _validate(args)
    caps = _parse_capacities(args.capacities)
    records = load_mixed(Path(args.data_dir) if args.data_dir else None)
    if args.predictor:
        # a trained predictor has seen its train/val splits: draw the batch from its test split only
        records = [r for r in records if split_of(r.prompt) == "test"]
    if len(records) < args.num_queries + 100:
        raise ValueError(
            f"-n {args.num_queries} is too large for {len(records)} records (need room for a training split)"
        )
    order = np.random.default_rng(args.seed).permutation(len(records))
    batch = [records[i] for i in order[: args.num_queries]]
    train = [records[i] for i in order[args.num_queries : args.num_queries + args.train_max]]
    tok = default_tokenizer()
    prompts = [r.prompt for r in batch]
    prompt_tokens = [len(ids) for ids in tok(prompts, add_special_tokens=False)["input_ids"]]
    actual = np.asarray(response_lengths(batch, tok), dtype=np.float64)

    predictor_desc = None
    predict = None
    if args.predictor:
        try:
            predict = _serving_predictor(args.predictor)
            predictor_desc = f"serving:{args.predictor}"
        except (ImportError, FileNotFoundError, OSError, ValueError) as e:
            predictor_desc = f"fallback (serving predictor unavailable: {e})"
    if predict is None:
        t0 = time.perf_counter()
        predict = fit_fallback_predictor([r.prompt for r in train], response_lengths(train, tok), args.seed)
        fitted = f"tfidf+ridge(log length) fitted on {len(train)} disjoint records in {time.perf_counter() - t0:.1f} s"
        predictor_desc = f"{predictor_desc}; {fitted}" if predictor_desc else fitted
    predicted = np.asarray(predict(prompts), dtype=np.float64)

    queries = [
        QueryLoad(f"q{i}", p, float(e)) for i, (p, e) in enumerate(zip(prompt_tokens, predicted, strict=True))
    ]
    oracle_queries = [
        QueryLoad(q.key, q.prompt_tokens, float(a)) for q, a in zip(queries, actual, strict=True)
    ]
    actual_total = [p + a for p, a in zip(prompt_tokens, actual.tolist(), strict=True)]

    equal_clusters = [ClusterView(f"c{i}", 1.0) for i in range(args.num_clusters)]
    unequal_clusters = [ClusterView(f"c{i}", c) for i, c in enumerate(caps)]
    names = [n for n in POLICY_ORDER if n in POLICIES]
    equal = {n: simulate(n, queries, actual_total, equal_clusters) for n in names}
    unequal = {n: simulate(n, queries, actual_total, unequal_clusters) for n in names}
    equal["token_oracle"] = simulate("token", oracle_queries, actual_total, equal_clusters)
    unequal["token_oracle"] = simulate("token", oracle_queries, actual_total, unequal_clusters)
    ideal_makespan = sum(actual_total) / sum(caps)

    small = {
        n: _small_batch_imbalance(n, queries, actual_total, equal_clusters, args.small_batch)
        for n in ("round_robin", "token")
    }
    log_a, log_p = np.log1p(actual), np.log1p(predicted)
    result = {
        "benchmark": "compare-policies",
        "workload": "mixed",
        "n": args.num_queries,
        "seed": args.seed,
        "tokenizer": "localmodels.default_tokenizer",
        "predictor": predictor_desc,
        "predictor_mae_tokens": float(np.mean(np.abs(predicted - actual))),
        "predictor_pearson_log": float(np.corrcoef(log_a, log_p)[0, 1]),
        "predicted_over_actual_sum": float(predicted.sum() / max(actual.sum(), 1.0)),
        "mean_actual_response_tokens": float(actual.mean()),
        "mean_prompt_tokens": float(np.mean(prompt_tokens)),
        "imbalance_round_robin": equal["round_robin"]["imbalance"],
        "imbalance_least_loaded": equal["least_loaded"]["imbalance"],
        "imbalance_token_equal": equal["token_equal"]["imbalance"],
        "imbalance_token": equal["token"]["imbalance"],
        "imbalance_token_oracle": equal["token_oracle"]["imbalance"],
        f"imbalance_round_robin_batch{args.small_batch}": small["round_robin"],
        f"imbalance_token_batch{args.small_batch}": small["token"],
        "capacities": caps,
        "makespan_round_robin_unequal": unequal["round_robin"]["makespan"],
        "makespan_token_unequal": unequal["token"]["makespan"],
        "makespan_ideal_unequal": ideal_makespan,
        "makespan_ratio_unequal": unequal["token"]["makespan"] / unequal["round_robin"]["makespan"],
        "makespan_ratio_unequal_token_equal": unequal["token_equal"]["makespan"]
        / unequal["round_robin"]["makespan"],
        "makespan_ratio_unequal_least_loaded": unequal["least_loaded"]["makespan"]
        / unequal["round_robin"]["makespan"],
        "makespan_token_over_ideal": unequal["token"]["makespan"] / ideal_makespan,
        "equal": equal,
        "unequal": unequal,
    }
    if args.timing_n > 0:
        result[f"assign_seconds_token_{args.timing_n}_k3"] = _assign_seconds(args.timing_n, 3, args.seed)
        result[f"assign_seconds_token_{args.timing_n}_k64"] = _assign_seconds(args.timing_n, 64, args.seed)
    if args.plot:
        _plot(args.plot, equal, unequal, caps)
        result["plot"] = args.plot
    return result


def _print_summary(result: dict) -> None:
    print(f"predictor: {result['predictor']}")
    print(
        f"predictor: MAE {result['predictor_mae_tokens']:.1f} tokens, Pearson(log) {result['predictor_pearson_log']:.3f}, "
        f"sum predicted/actual {result['predicted_over_actual_sum']:.3f}"
    )
    print(f"{'policy':<14} {'imbalance':>10} {'(pred)':>8} {'makespan 1:2:4':>15} {'(pred)':>10}")
    for name in result["equal"]:
        e, u = result["equal"][name], result["unequal"][name]
        print(
            f"{name:<14} {e['imbalance']:>10.4f} {e['imbalance_predicted']:>8.4f} {u['makespan']:>15.0f} "
            f"{u['makespan_predicted']:>10.0f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fleetbatch loadgen compare-policies", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    errors = (ValueError, FileNotFoundError)
    return run_main(parser, argv, _run_and_summarise, prog="compare-policies", errors=errors, print_json=True)


def _run_and_summarise(args: argparse.Namespace) -> dict:
    result = run(args)
    _print_summary(result)
    return result


if __name__ == "__main__":
    sys.exit(main())
