"""The length predictor shipped with the project, and how a deployment chooses its predictor.

``predictor/shipped_model/`` (package data) is an ordinary version directory (see
:mod:`predictor.store`), of one model or an ensemble (each member in its sub-directory), with the
weights in fp16 safetensors, each model's WordPiece tokenizer, ``buckets.json``
and ``predictor.json``, whose ``shipped`` entry names the serving tokenizer its lengths were counted
in, the model it was exported from and its test figures; ``reference.json`` holds the fp32 source
model's predictions on a few fixed prompts, so a test can check that the fp16 copy predicts the same.
DistilBERT members keep only the position embeddings their prompt length reaches (``max_len`` of
512 rows): the rest are never read. ``fast.json`` and each member's ``model.int8.onnx`` are the fast
serving path (:mod:`predictor.fastpath`, built by ``python -m predictor.fast_build`` after an export,
which replaces the directory); all of it stays under :data:`MAX_BYTES` (8 MiB).

``fleetbatch gateway up`` (and ``fleetbatch loadgen demo``, which starts it) use it unless ``--predictor`` says
otherwise: :func:`choose` maps ``shipped`` to this directory and ``heuristic`` to no model.

Rebuild it (the commands are in ``docs/design/predictor.md``)::

    fleetbatch predictor train --threads 1 --max-minutes 20 --out /tmp/pred_ship/model
    python -m predictor.shipped export --from /tmp/pred_ship/model
    fleetbatch predictor eval --predictor predictor/shipped_model --plot /tmp/pred_ship/cm.png --report /tmp/pred_ship/eval.json
    python -m predictor.shipped record-eval /tmp/pred_ship/eval.json
    python -m predictor.fast_build --predictor shipped --threads 1
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from cliutil import run_main
from localmodels import default_tokenizer
from predictor import store
from predictor.choice import HEURISTIC, SHIPPED, SHIPPED_DIR, choose, is_shipped  # noqa: F401  (known from here too)
from predictor.versions import describe  # noqa: F401  (known from here too)

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference.json"
MAX_BYTES = 8 * 1024 * 1024  # 5 MiB until the fast path's ONNX members (2 x 1.2 MB) came
#: What the serving engines of ``fleetbatch gateway up`` count tokens with (``fleetbatch engine serve`` without ``--served-model``).
DEFAULT_SERVING_TOKENIZER = "localmodels.default_tokenizer"
EVAL_KEYS = (
    "n",
    "split",
    "kendall_tau",
    "mae_tokens",
    "sum_ratio",
    "accuracy",
    "tfidf_ridge_kendall_tau",
    "tfidf_ridge_mae_tokens",
    "tfidf_lr_kendall_tau",
    "tfidf_lr_mae_tokens",
    "fallback_kendall_tau",
    "fallback_mae_tokens",
)

#: Fixed prompts whose fp32 predictions are stored with the shipped model (``reference.json``).
REFERENCE_PROMPTS = (
    "What is 7 times 8?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a SQL query that lists the ten customers with the highest total order value.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain the difference between TCP and UDP.",
    "Give me three tips for staying focused while working from home.",
    "Translate 'good morning' into French.",
    "You are a pirate captain. Greet your new crew and tell them about the voyage ahead.",
    "Summarise the causes of the First World War in a few paragraphs.",
    "Is 97 a prime number? Answer yes or no.",
    "Compose a poem about autumn leaves.",
    "List the planets of the solar system in order from the sun.",
    "Describe how a refrigerator works, step by step, for a ten-year-old.",
    "Create a weekly meal plan for a vegetarian athlete, with a shopping list.",
    "Fix the bug: def add(a, b): return a - b",
)


def vocab_sha1(tokenizer) -> str:
    """A fingerprint of a tokenizer's vocabulary (sorted ``token -> id`` pairs)."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha1(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def serving_tokenizer_info(tokenizer=None, name: str = DEFAULT_SERVING_TOKENIZER) -> dict:
    """Which tokenizer the labels' lengths were counted in (the default serving one unless given)."""
    if tokenizer is None:
        tokenizer = default_tokenizer()
    return {"name": name, "vocab_size": len(tokenizer), "vocab_sha1": vocab_sha1(tokenizer)}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def reference_predictions(loaded: store.LoadedModel, prompts=REFERENCE_PROMPTS) -> dict:
    """Bucket probabilities, argmax buckets and expected tokens of ``loaded`` on ``prompts``."""
    probs = loaded.predict_proba(list(prompts))
    return {
        "prompts": list(prompts),
        "probs": probs.round(6).tolist(),
        "bucket": probs.argmax(1).tolist(),
        "expected_tokens": loaded.buckets.expected(probs).round(4).tolist(),
    }


def _write_fp16(part: store.LoadedModel, dest: Path) -> None:
    """One single model's files in ``dest``, its weights as fp16 (a copy: ``part`` stays as it is).

    A DistilBERT model keeps the first ``max_len`` position embeddings only: prompts are cut to
    ``max_len`` tokens, so the others are never read (131 KB of fp16 at 512 x 128)."""
    dest.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(part.model)
    positions = getattr(model.config, "max_position_embeddings", 0)
    if model.config.model_type == "distilbert" and part.max_len < positions:
        model.resize_position_embeddings(part.max_len)
    model.half().save_pretrained(str(dest), safe_serialization=True)
    part.tokenizer.save_pretrained(str(dest))
    (dest / "special_tokens_map.json").unlink(missing_ok=True)  # duplicated in tokenizer_config.json


def _weights_sha1(root: Path, loaded: store.LoadedModel) -> str:
    """SHA-1 over the weights file(s): one model's, or each member's in order."""
    h = hashlib.sha1()
    for name in loaded.meta.get("members") or ["."]:
        h.update((root / name / "model.safetensors").read_bytes())
    return h.hexdigest()


def export(
    source: str | os.PathLike,
    dest: str | os.PathLike = SHIPPED_DIR,
    serving_tokenizer: dict | None = None,
    prompts=REFERENCE_PROMPTS,
    max_bytes: int = MAX_BYTES,
) -> Path:
    """Copy the model at ``source`` (a version or parent directory; one model or an ensemble, whose
    members go to their sub-directories) to ``dest`` with fp16 weights.

    Writes ``reference.json`` (the source's predictions on ``prompts``) and records the source, the
    serving tokenizer (``serving_tokenizer``, by default :func:`serving_tokenizer_info`) and the
    source's validation history in ``predictor.json``. Replaces ``dest`` only once complete.
    """
    loaded = store.load(source)
    reference = reference_predictions(loaded, prompts)
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if loaded.members:
        for name, member in zip(store.member_names(loaded.path), loaded.members, strict=True):
            _write_fp16(member, tmp / name)
            store.write_version(
                tmp / name, None, None, member.buckets, member.meta, store.read_metrics(member.path)
            )
    else:
        _write_fp16(loaded, tmp)
    meta = dict(loaded.meta)
    # the weights' hash tells two exports of models that were each their run's v1 apart
    meta["version"] = f"shipped-{loaded.version}-{_weights_sha1(tmp, loaded)[:8]}"
    meta["shipped"] = {
        "from": str(loaded.path),
        "from_version": loaded.version,
        "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dtype": "float16",
        "serving_tokenizer": serving_tokenizer or serving_tokenizer_info(),
        "test": {},
    }
    (tmp / REFERENCE_FILE).write_text(json.dumps(reference), encoding="utf-8")
    store.write_version(tmp, None, None, loaded.buckets, meta, store.read_metrics(loaded.path))
    size = _dir_bytes(tmp)
    if size > max_bytes:
        shutil.rmtree(tmp)
        raise ValueError(
            f"the exported model takes {size / 2**20:.2f} MiB, over the {max_bytes / 2**20:.2f} MiB limit"
        )
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    log.info("exported %s -> %s (%.2f MiB)", loaded.path, dest, size / 2**20)
    return dest


def record_eval(report: str | os.PathLike | dict, dest: str | os.PathLike = SHIPPED_DIR) -> dict:
    """Store the headline figures of a ``fleetbatch predictor eval --report`` file in the shipped ``predictor.json``."""
    r = report if isinstance(report, dict) else json.loads(Path(report).read_text(encoding="utf-8"))
    meta_path = Path(dest) / store.META_FILE
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    figures = {k: r[k] for k in EVAL_KEYS if k in r}
    meta.setdefault("shipped", {})["test"] = figures
    meta_path.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return figures


def _run(args: argparse.Namespace) -> dict:
    if args.command == "export":
        info = None
        if args.served_model:
            tok = AutoTokenizer.from_pretrained(args.served_model, local_files_only=True)
            info = serving_tokenizer_info(tok, name=str(args.served_model))
        out = export(args.source, args.out, info)
        return {"model_dir": str(out), "bytes": _dir_bytes(out)}
    return record_eval(args.report, args.out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m predictor.shipped", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser(
        "export", help="copy a trained model (one, or an ensemble) into the package with fp16 weights"
    )
    e.add_argument("--from", dest="source", required=True, help="model directory (version or parent)")
    e.add_argument("--out", default=str(SHIPPED_DIR), help="destination (default: the shipped model)")
    e.add_argument("--served-model", default=None, help="model directory whose tokenizer counted lengths")
    r = sub.add_parser(
        "record-eval", help="store `fleetbatch predictor eval --report` figures in predictor.json"
    )
    r.add_argument("report")
    r.add_argument("--out", default=str(SHIPPED_DIR))
    return run_main(p, argv, _run, prog="python -m predictor.shipped", print_json=True)


if __name__ == "__main__":
    sys.exit(main())
