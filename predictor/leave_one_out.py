"""``fleetbatch predictor eval --leave-one-model-out``: does the online calibration learn a model it never saw?

The shipped predictor was trained on the ``mixed`` workload, whose alpaca_eval part holds the answers of one
model (:data:`predictor.adapt._DEFAULT_ALPACA`). ``alpaca_eval/`` in the shared data holds the answers of
other models to the same 805 prompts. For each of them (rows matched by prompt text, not position):

1. **Evaluation prompts** are always prompts outside the shipped model's training split (val + test by
   :func:`predictor.labeled.split_of`: 144 of 805). They are cut, per seed, into ``--lomo-folds`` seeded folds;
   each fold is evaluated once per seed, with a calibration fed nothing of that fold.
2. **Observations**: the ``K`` pairs (raw estimate, observed length) fed to the calibration
   (:class:`predictor.calibration.Calibration`, from :class:`workqueue.length_stats.LengthStats`) are drawn in
   a seeded random order from the other prompts, never an evaluated one: ``--observe-order heldout-first``
   (default) takes the other folds' held-out prompts first, then training-split prompts as needed (K=400
   needs about 290 of them); ``train-first`` the reverse. The predictor has seen the training-split prompts
   (with another model's lengths), so its raw estimates there are not those of new prompts: the table's
   ``train-split bias`` (held-out over training-split ratio of observed to raw tokens) measures it.
3. **Figures** on the evaluated prompts, pooled over the folds of a seed, then averaged over seeds: the token-sum
   ratio (predicted / actual), the ratio within each fifth of the calibrated predictions, and Kendall tau (the
   mean over folds; each fold's calibration is one strictly increasing map, so it equals the raw one's).
4. **Adapt** (:mod:`predictor.adapt`): the same observations retrain the predictor (its ``relabeled`` data,
   ``WorkQueue.record_observed`` into an embedded Redis, ``fleetbatch predictor retrain``), for the first
   ``--adapt-folds`` folds of the first seed; its calibrated expectation is scored on those folds' prompts.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau
from tqdm import tqdm

from fleetdata.datasets import alpaca_eval_models
from predictor import adapt, store
from predictor.calibration import Calibration
from predictor.commands import retrain
from predictor.commands.common import DEFAULT_OUT, comma_list, serving_tokenizer
from predictor.labeled import LabeledSet, load_labeled, split_of
from predictor.serving import LengthPredictor
from workqueue.embedded import EmbeddedRedis
from workqueue.length_stats import LengthStats

log = logging.getLogger("predictor")

KS = (0, 100, 400)
ADAPT_KS = (100, 400)
ORDERS = ("heldout-first", "train-first")
GOALS = {"k400_sum": (0.9, 1.1), "k400_quintile": (0.8, 1.25), "k100_sum": (0.8, 1.25)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the leave-one-model-out evaluation (on ``fleetbatch predictor eval``)."""
    p.add_argument(
        "--leave-one-model-out",
        action="store_true",
        help="instead of scoring a split: for each alpaca_eval model the predictor never saw, feed the online "
        "calibration K of its observed answers (drawn, seeded, from prompts never evaluated: held-out prompts "
        "of other folds first, then training-split ones) and score the rest of the held-out (val+test) "
        "prompts, beside `predictor adapt` retrained on the same observations (the shipped model unless "
        "--predictor is given; docs/design/predictor.md)",
    )
    p.add_argument(
        "--lomo-models", default=None, help="comma list of alpaca_eval models (default: all unseen)"
    )
    p.add_argument(
        "--lomo-ks", default=",".join(map(str, KS)), help="observation counts K (default 0,100,400)"
    )
    p.add_argument(
        "--lomo-seeds", type=int, default=3, help="seeds, each a new fold cut and order (default 3)"
    )
    p.add_argument("--lomo-folds", type=int, default=4, help="folds of the held-out prompts (default 4)")
    p.add_argument("--observe-order", choices=ORDERS, default=ORDERS[0], help="observation pool order")
    p.add_argument(
        "--adapt-ks",
        default=",".join(map(str, ADAPT_KS)),
        help="Ks at which `predictor adapt` retrains too (default 100,400; 'none' to skip)",
    )
    p.add_argument("--adapt-models", default=None, help="comma list of models adapt runs for (default: all)")
    p.add_argument(
        "--adapt-folds", type=int, default=1, help="folds of seed 0 adapt retrains for (default 1)"
    )
    p.add_argument("--adapt-epochs", type=float, default=3.0, help="adapt's retrain epochs (default 3)")
    p.add_argument("--adapt-original", type=int, default=2000, help="adapt: original examples (default 2000)")


@dataclass
class Figures:
    """Per seed: the sum ratio, the five quintile ratios, the per-fold taus (raw and calibrated)."""

    sums: list[float] = field(default_factory=list)
    quintiles: list[list[float]] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    raw_taus: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def add_seed(self, pred: np.ndarray, true: np.ndarray) -> None:
        self.sums.append(float(pred.sum() / true.sum()))
        self.quintiles.append(quintile_ratios(pred, true))

    def summary(self) -> dict:
        return {
            "sum_ratio": round(float(np.mean(self.sums)), 4),
            "quintiles": [round(float(x), 4) for x in np.mean(self.quintiles, axis=0)],
            "tau": round(float(np.mean(self.taus)), 4),
            "raw_tau": round(float(np.mean(self.raw_taus)), 4),
            "seeds": len(self.sums),
            "seconds": round(self.seconds, 1),
        }


def quintile_ratios(pred: np.ndarray, true: np.ndarray) -> list[float]:
    """Predicted over actual tokens within each fifth of the predictions (ties stay in one fifth)."""
    q = np.quantile(pred, [0.2, 0.4, 0.6, 0.8])
    b = np.searchsorted(q, pred, side="right")
    return [
        float(pred[b == k].sum() / max(1.0, true[b == k].sum())) if np.any(b == k) else 1.0 for k in range(5)
    ]


def expected_tokens(loaded: store.LoadedModel, prompts: list[str]) -> np.ndarray:
    """The serving path's ``expected_tokens`` of each prompt (the raw estimate the workers record)."""
    return np.array([p.expected_tokens for p in LengthPredictor(loaded).predict(prompts)], dtype=np.float64)


def tau(a: np.ndarray, b: np.ndarray) -> float:
    t = kendalltau(a, b)[0]
    return 0.0 if np.isnan(t) else float(t)


def observation_pool(rng: np.random.Generator, other_heldout: np.ndarray, train: np.ndarray, order: str):
    first, second = (other_heldout, train) if order == "heldout-first" else (train, other_heldout)
    return np.concatenate([rng.permutation(first), rng.permutation(second)]).astype(int)


def calibrated(raw: np.ndarray, true: np.ndarray, observed: np.ndarray, evaluated: np.ndarray) -> np.ndarray:
    stats = LengthStats()
    for j in observed:
        stats.add(float(raw[j]), float(true[j]))
    return Calibration.from_stats(stats).apply(raw[evaluated])


@dataclass
class Context:
    """What every model's evaluation shares: the reference prompts, their raw estimates and splits."""

    prompts: list[str]
    raw: np.ndarray
    heldout: np.ndarray  # bool per prompt: outside the shipped model's training split
    args: argparse.Namespace
    original: LabeledSet | None = None  # the training data, for adapt's relabeled set


class AdaptRunner:
    """Retrain the predictor on observations as ``fleetbatch predictor adapt`` does and predict prompts."""

    def __init__(self, ctx: Context, redis_dir: Path) -> None:
        self.ctx, self.dir = ctx, redis_dir
        self.server = EmbeddedRedis(redis_dir / "redis", persist=False)
        self.runs = 0

    def close(self) -> None:
        self.server.close()

    def predict(self, model: str, obs: LabeledSet, raw_obs: np.ndarray, prompts: list[str]) -> np.ndarray:
        a = self.ctx.args
        self.runs += 1
        served = LabeledSet(
            self.ctx.prompts, np.zeros(len(self.ctx.prompts), dtype=np.int64), [""] * len(self.ctx.prompts)
        )
        data = adapt.relabeled(
            self.ctx.original, served, obs, self.dir / f"relabeled{self.runs}.jsonl", a.adapt_original, 0
        )
        # only the newest len(obs) observations are read: earlier runs' stay in the list unread
        n = adapt.record(self.server.url, obs, raw_obs, f"served:alpaca_eval:{model}")
        rargs = argparse.Namespace(
            predictor=a.lomo_predictor,
            original=a.adapt_original,
            epochs=a.adapt_epochs,
            lr=3e-4,
            batch_size=32,
            seed=0,
            device=a.device,
            data_dir=a.data_dir,
            served_model=a.served_model,
        )
        argv = adapt.retrain_argv(rargs, self.server.url, str(self.dir / f"m{self.runs}"), n, str(data))
        result = retrain.run(retrain.parser().parse_args(argv[1:]))
        return expected_tokens(store.load(result["model_dir"], a.device), prompts)


def evaluate_model(
    ctx: Context, model: str, true: np.ndarray, ks: list[int], adapt_ks: list[int], runner, bar
):
    """Figures of one served model: ``{"calibration": {K: Figures}, "adapt": {K: Figures}}``."""
    a, raw = ctx.args, ctx.raw
    known = ~np.isnan(true)
    heldout = np.flatnonzero(ctx.heldout & known)
    train = np.flatnonzero(~ctx.heldout & known)
    cal = {k: Figures() for k in ks}
    ada = {k: Figures() for k in adapt_ks}
    for seed in range(a.lomo_seeds):
        rng = np.random.default_rng(seed)
        folds = np.array_split(rng.permutation(heldout), a.lomo_folds)
        pred = {k: np.zeros(len(raw)) for k in ks}
        adapted = {k: ([], []) for k in adapt_ks}
        for f, fold in enumerate(folds):
            other = np.concatenate([g for i, g in enumerate(folds) if i != f])
            pool = observation_pool(rng, other, train, a.observe_order)
            for k in ks:
                if k > len(pool):
                    raise ValueError(f"K={k} exceeds the {len(pool)} prompts {model} can be observed on")
                start = time.perf_counter()
                pred[k][fold] = calibrated(raw, true, pool[:k], fold)
                cal[k].seconds += time.perf_counter() - start
                cal[k].taus.append(tau(pred[k][fold], true[fold]))
                cal[k].raw_taus.append(tau(raw[fold], true[fold]))
            if seed == 0 and f < a.adapt_folds:
                for k in adapt_ks:
                    start = time.perf_counter()
                    obs = LabeledSet(
                        [ctx.prompts[j] for j in pool[:k]], true[pool[:k]].astype(np.int64), ["observed"] * k
                    )
                    p = runner.predict(model, obs, raw[pool[:k]], [ctx.prompts[j] for j in fold])
                    ada[k].seconds += time.perf_counter() - start
                    ada[k].taus.append(tau(p, true[fold]))
                    ada[k].raw_taus.append(tau(raw[fold], true[fold]))
                    adapted[k][0].append(p)
                    adapted[k][1].append(true[fold])
                    bar.update(1)
            bar.update(1)
        for k in ks:
            cal[k].add_seed(pred[k][heldout], true[heldout])
        for k in adapt_ks:
            if adapted[k][0]:  # adapt retrains for the first seed's first folds only
                ada[k].add_seed(np.concatenate(adapted[k][0]), np.concatenate(adapted[k][1]))
    return {"calibration": cal, "adapt": ada}


def _ints(text: str) -> list[int]:
    return [] if text.strip().lower() == "none" else sorted({int(x) for x in comma_list(text)})


def _row(model: str, k: int, method: str, s: dict) -> str:
    q = " ".join(f"{x:5.2f}" for x in s["quintiles"])
    return f"{model[:26]:<26} {k:>4} {method:<11} {s['sum_ratio']:6.3f}  {q}  {s['raw_tau']:6.3f} {s['tau']:6.3f}"


def run(args: argparse.Namespace) -> dict:
    """The evaluation; prints a table per model and K and returns the JSON summary."""
    started = time.perf_counter()
    args.lomo_predictor = store.SHIPPED_NAME if args.predictor == DEFAULT_OUT else args.predictor
    loaded = store.load(args.lomo_predictor, args.device)
    trained = set().union(*(adapt.trained_alpaca_models(m.meta) for m in loaded.parts))
    if not trained:
        raise ValueError(f"{loaded.path} was trained on no alpaca_eval answers: no reference prompt set")
    reference = sorted(trained)[0]
    present = alpaca_eval_models(Path(args.data_dir) if args.data_dir else None)
    models = comma_list(args.lomo_models) if args.lomo_models else [m for m in present if m not in trained]
    bad = [m for m in models if m in trained or m not in present]
    if bad:
        raise ValueError(
            f"--lomo-models: {', '.join(bad)} not an unseen alpaca_eval model ({', '.join(present)})"
        )
    ks, adapt_ks = _ints(args.lomo_ks), _ints(args.adapt_ks)
    adapt_models = set(comma_list(args.adapt_models)) if args.adapt_models else set(models)
    if args.lomo_folds < 2 or args.lomo_seeds < 1 or args.adapt_folds < 0:
        raise ValueError("--lomo-folds must be at least 2, --lomo-seeds at least 1, --adapt-folds at least 0")
    tokenizer = serving_tokenizer(args.served_model)
    ref = load_labeled(f"alpaca_eval:{reference}", args.data_dir, tokenizer)
    prompts = list(dict.fromkeys(ref.prompts))
    index = {p: i for i, p in enumerate(prompts)}
    raw = expected_tokens(loaded, prompts)
    heldout = np.array([split_of(p) != "train" for p in prompts])
    ctx = Context(prompts, raw, heldout, args)
    run_adapt = bool(adapt_ks) and args.adapt_folds > 0 and bool(adapt_models & set(models))
    if run_adapt:
        ctx.original = load_labeled(args.dataset, args.data_dir, tokenizer)
    log.info(
        "%d prompts (%d held out), reference %s, models %s", len(prompts), heldout.sum(), reference, models
    )
    results, bias = {}, {}
    per_model_units = args.lomo_seeds * args.lomo_folds
    units = len(models) * per_model_units + len(adapt_models & set(models)) * args.adapt_folds * len(adapt_ks)
    with tempfile.TemporaryDirectory(prefix="fleetbatch-lomo-") as tmp, tqdm(total=units, desc="lomo") as bar:
        runner = AdaptRunner(ctx, Path(tmp)) if run_adapt else None
        try:
            for m in models:
                data = load_labeled(f"alpaca_eval:{m}", args.data_dir, tokenizer)
                true = np.full(len(prompts), np.nan)
                for p, n in zip(data.prompts, data.lengths, strict=True):
                    if p in index:
                        true[index[p]] = float(n)
                known = ~np.isnan(true)
                h, t = heldout & known, ~heldout & known
                bias[m] = round(float((true[h].sum() / raw[h].sum()) / (true[t].sum() / raw[t].sum())), 4)
                a_ks = adapt_ks if (run_adapt and m in adapt_models) else []
                results[m] = evaluate_model(ctx, m, true, ks, a_ks, runner, bar)
        finally:
            if runner is not None:
                runner.close()
    return report(args, reference, models, ks, results, bias, time.perf_counter() - started)


def report(
    args, reference: str, models: list[str], ks: list[int], results: dict, bias: dict, seconds: float
) -> dict:
    summ = {
        m: {method: {k: f.summary() for k, f in figs.items()} for method, figs in r.items()}
        for m, r in results.items()
    }
    print(
        f"leave-one-model-out: predictor {args.lomo_predictor} (trained on {reference}'s answers), "
        f"{args.lomo_seeds} seeds x {args.lomo_folds} folds of the held-out prompts, observations "
        f"{args.observe_order}"
    )
    print(
        f"{'model':<26} {'K':>4} {'method':<11} {'sum':>6}  {'fifths of the predictions':<29}  {'tau raw':>6} {'tau':>6}"
    )
    for m in models:
        for k in ks:
            print(_row(m, k, "calibration", summ[m]["calibration"][k]))
            if k in summ[m]["adapt"]:
                print(_row(m, k, "adapt", summ[m]["adapt"][k]))
        print(f"{'':<26} train-split bias (held-out / training-split observed-to-raw ratio) {bias[m]:.3f}")

    def cal(k: int, key: str) -> dict:
        return {m: summ[m]["calibration"][k][key] for m in models if k in summ[m]["calibration"]}

    out: dict = {
        "predictor": str(args.lomo_predictor),
        "reference_model": reference,
        "models": models,
        "ks": ks,
        "seeds": args.lomo_seeds,
        "folds": args.lomo_folds,
        "observe_order": args.observe_order,
        "sum_ratio_by_model": cal(400, "sum_ratio"),
        "sum_ratio_by_model_quintile": cal(400, "quintiles"),
        "sum_ratio_by_model_k100": cal(100, "sum_ratio"),
        "sum_ratio_by_model_k0": cal(0, "sum_ratio"),
        "tau_by_model": {str(k): cal(k, "tau") for k in ks},
        "raw_tau_by_model": {str(k): cal(k, "raw_tau") for k in ks},
        "train_split_bias": bias,
        "adapt": {m: {str(k): s for k, s in summ[m]["adapt"].items()} for m in models if summ[m]["adapt"]},
        "calibration": {m: {str(k): s for k, s in summ[m]["calibration"].items()} for m in models},
        "seconds": round(seconds, 1),
    }
    lo, hi = GOALS["k400_sum"]
    goals = {}
    if out["sum_ratio_by_model"]:
        goals["k400_sum"] = all(lo <= v <= hi for v in out["sum_ratio_by_model"].values())
        qlo, qhi = GOALS["k400_quintile"]
        goals["k400_quintile"] = all(
            qlo <= v <= qhi for q in out["sum_ratio_by_model_quintile"].values() for v in q
        )
    if out["sum_ratio_by_model_k100"]:
        lo, hi = GOALS["k100_sum"]
        goals["k100_sum"] = all(lo <= v <= hi for v in out["sum_ratio_by_model_k100"].values())
    out["goals"] = goals
    out["goals_met"] = bool(goals) and all(goals.values())
    return out
