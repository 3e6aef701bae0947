"""Build a model version's fast serving path (:mod:`predictor.fastpath`) and choose its recipe on the
VALIDATION split.

Every candidate runs all of the version's members (an ensemble stays an ensemble: a member alone came
within 0.0006 of the shipped ensemble's validation tau but lost 0.0024 on test, which validation cannot
tell apart), each as the ONNX graph of :mod:`predictor.onnx_export` in ONNX Runtime, length-sorted chunks
of 16 prompts:

* ``ort-fp32``: the graph in fp32 (the same logits as torch, to about 1e-6);
* ``ort-int8``: dynamic int8 (per-channel int8 weights, activations quantized at run time).

The rule (:func:`choose`), fixed before any test figure was looked at: **the fastest candidate whose
validation Kendall tau is at least the torch model's validation tau minus** :data:`TOLERANCE`
**(0.001)**; speed is ms per query at batch 64 on the process's threads (``--threads 1``), timed
interleaved with the torch path on validation prompts. Half of the 0.002 that the test may lose is
left for the difference between the splits. No candidate passing: no fast path (torch serves).

Then the chosen recipe's file goes into each member's directory and ``fast.json`` records the rule, every
candidate's figures and the choice. Run (export time: needs ``onnx``)::

    python -m predictor.fast_build --predictor shipped --threads 1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from cliutil import run_main
from predictor import fastpath, onnx_export, store
from predictor.evaluation import classifier_figures
from predictor.labeled import LabeledSet, load_labeled, split

log = logging.getLogger("predictor")

TOLERANCE = 0.001
#: candidate -> the file each member's directory gets
CANDIDATES = {"ort-fp32": "model.onnx", "ort-int8": "model.int8.onnx"}


def rule_text(tolerance: float = TOLERANCE) -> str:
    """The rule of :func:`choose` in words, as ``fast.json`` and ``bench --compare`` record it."""
    return (
        "the fastest candidate (ms per query at batch 64, timed on validation prompts) whose validation "
        f"Kendall tau >= the torch model's validation tau - {tolerance}"
    )


def choose(torch_val_tau: float, candidates: dict[str, dict], tolerance: float = TOLERANCE) -> str | None:
    """The rule: among ``candidates`` (name -> ``{"val_tau", "ms_per_query"}``) whose ``val_tau`` is at
    least ``torch_val_tau - tolerance``, the one with the lowest ``ms_per_query``; None if none passes."""
    ok = [n for n, c in candidates.items() if c["val_tau"] >= torch_val_tau - tolerance - 1e-12]
    return min(ok, key=lambda n: (candidates[n]["ms_per_query"], n)) if ok else None


def tau_of(loaded: store.LoadedModel, probs: np.ndarray, data: LabeledSet, train: LabeledSet) -> float:
    """Kendall tau of ``loaded``'s declared point estimate from ``probs`` on ``data`` (as ``predictor eval``)."""
    b = loaded.buckets
    figures = classifier_figures(probs, data.lengths, b, b.label(train.lengths), loaded.point_estimate)
    return float(figures["kendall_tau"])


def labeled_splits(dataset: str, data_dir: str | None) -> dict[str, LabeledSet]:
    """The train/val/test splits of ``dataset``, lengths in the default serving tokenizer (as ``predictor eval``)."""
    return split(load_labeled(dataset, data_dir, None))


def interleaved_ms(
    paths: dict[str, Callable[[list[str]], object]], batches: Sequence[list[str]], warmup: int = 2
) -> dict[str, list[float]]:
    """Milliseconds of each path on each batch, the paths taking turns batch by batch (the order
    rotating), so that noise on a shared machine falls on all of them alike."""
    names = list(paths)
    for bt in batches[:warmup]:
        for name in names:
            paths[name](bt)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i, bt in enumerate(batches):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t = time.perf_counter()
            paths[name](bt)
            times[name].append(1000 * (time.perf_counter() - t))
    return times


def sample_batches(prompts: Sequence[str], n: int, batch_size: int, seed: int = 0) -> list[list[str]]:
    """``n`` prompts drawn without replacement (``seed``), in batches of ``batch_size``."""
    rng = np.random.default_rng(seed)
    picked = [prompts[i] for i in rng.choice(len(prompts), size=min(n, len(prompts)), replace=False)]
    return [picked[i : i + batch_size] for i in range(0, len(picked), batch_size)]


def _export_candidates(loaded: store.LoadedModel) -> None:
    """Each candidate's file beside each single model of ``loaded``, named ``candidate.<file>``."""
    for part in loaded.parts:
        fp32 = onnx_export.export(part.model, part.path / f"candidate.{CANDIDATES['ort-fp32']}")
        onnx_export.quantize(fp32, part.path / f"candidate.{CANDIDATES['ort-int8']}")


def build(
    model_dir: str | os.PathLike,
    dataset: str = "mixed",
    data_dir: str | None = None,
    n_time: int = 1024,
    batch_size: int = 64,
    tolerance: float = TOLERANCE,
) -> dict:
    """Export the candidates, score and time them on the validation split, keep the chosen one (the rule
    of :func:`choose`) and write ``fast.json``; returns that record."""
    loaded = store.load(model_dir)
    (loaded.path / fastpath.FAST_FILE).unlink(missing_ok=True)  # no stale record while the files change
    _export_candidates(loaded)
    sp = labeled_splits(dataset, data_dir)
    val, train = sp["val"], sp["train"]
    with torch.inference_mode():
        torch_probs = loaded.predict_proba(val.prompts, batch_size)
    torch_tau = tau_of(loaded, torch_probs, val, train)
    fast = {
        name: fastpath.FastModel.from_files(loaded, f"candidate.{file}", recipe={"recipe": name})
        for name, file in CANDIDATES.items()
    }
    figures: dict[str, dict] = {}
    for name, model in fast.items():
        probs = model.predict_proba(val.prompts)
        figures[name] = {
            "val_tau": round(tau_of(loaded, probs, val, train), 4),
            "max_abs_prob_diff": float(np.abs(probs - torch_probs).max()),
        }
    paths: dict[str, Callable] = {"torch": lambda bt: loaded.predict_proba(bt, batch_size)}
    paths.update({name: model.predict_proba for name, model in fast.items()})
    with torch.inference_mode():
        times = interleaved_ms(paths, sample_batches(val.prompts, n_time, batch_size))
    n_queries = sum(len(b) for b in sample_batches(val.prompts, n_time, batch_size))
    ms = {name: sum(t) / n_queries for name, t in times.items()}
    for name in fast:
        figures[name]["ms_per_query"] = round(ms[name], 4)
        figures[name]["ms_ratio_to_torch"] = round(ms[name] / ms["torch"], 4)
    chosen = choose(round(torch_tau, 4), figures, tolerance)
    for part in loaded.parts:
        for name, file in CANDIDATES.items():
            cand = part.path / f"candidate.{file}"
            if name == chosen:
                os.replace(cand, part.path / file)
            else:
                cand.unlink(missing_ok=True)
                (part.path / file).unlink(missing_ok=True)
    record = {
        "recipe": chosen,
        "file": CANDIDATES.get(chosen or "", None),
        "chunk": fastpath.DEFAULT_CHUNK,
        "rule": rule_text(tolerance),
        "tolerance": tolerance,
        "val_tau_torch": round(torch_tau, 4),
        "torch_ms_per_query": round(ms["torch"], 4),
        "candidates": figures,
        "validation": {"dataset": dataset, "n": len(val), "timed_queries": n_queries},
        "threads": torch.get_num_threads(),
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if chosen is None:
        log.warning("no candidate kept the validation tau within %s: no fast path", tolerance)
        return record
    (loaded.path / fastpath.FAST_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    log.info("fast path of %s: %s (%s)", loaded.path, chosen, figures[chosen])
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m predictor.fast_build", description=__doc__.split("\n\n")[0])
    p.add_argument("--predictor", default=store.SHIPPED_NAME, help="model directory (default: shipped)")
    p.add_argument(
        "--dataset", default="mixed", help="dataset whose validation split chooses (default mixed)"
    )
    p.add_argument("--data-dir", default=None, help="shared data directory")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for the timing (default 1)")
    p.add_argument("-n", "--num-queries", type=int, default=1024, help="validation queries to time")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")

    def run(args: argparse.Namespace) -> dict:
        torch.set_num_threads(args.threads)
        return build(args.predictor, args.dataset, args.data_dir, args.num_queries)

    return run_main(p, argv, run, prog="python -m predictor.fast_build", print_json=True)


if __name__ == "__main__":
    sys.exit(main())
