"""Resumable training: the whole state of :func:`predictor.training.train` (weights, optimizer,
schedule, moving average, best weights so far, data order, random generators, history), saved
atomically at every evaluation. A long run (a pretrained teacher: about an hour on the 2-core CPU)
stopped by ``--max-minutes``, a crash or the end of a session goes on from its last evaluation when
the same command runs again with the same ``--checkpoint``. A tokenizer trained for the run (the
WordPiece trainer may pick other tokens on another try) is kept beside it, in ``FILE.tokenizer/``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer

log = logging.getLogger(__name__)


def fingerprint(
    tokenizer, n_train: int, n_labels: int, total_steps: int, model_config: dict, train_config: dict
) -> str:
    """What a checkpoint must match to be resumed: vocabulary, training-set size, buckets, steps,
    the model's architecture (``model_config``) and the training settings (``train_config``;
    ``max_minutes`` left out: a resumed run may be given more time)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    settings = {k: v for k, v in train_config.items() if k != "max_minutes"}
    run = json.dumps([n_train, n_labels, total_steps, model_config, settings], sort_keys=True, default=str)
    return hashlib.sha1((run + vocab).encode("utf-8")).hexdigest()


def save(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` to ``path`` (a temporary file, then renamed: never a half-written checkpoint)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load(path: str | os.PathLike | None, fingerprint_: str) -> dict | None:
    """The state saved at ``path``, or None when there is none; a checkpoint of another run is an error."""
    if path is None or not Path(path).is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("fingerprint") != fingerprint_:
        raise ValueError(
            f"checkpoint {path} was written by another run (other data, buckets, tokenizer, length, model or "
            "training settings); "
            "remove it or name another --checkpoint"
        )
    log.info("resuming training from %s at step %d", path, state["step"])
    return state


def _tokenizer_dir(path: str | os.PathLike) -> Path:
    return Path(f"{path}.tokenizer")


def saved_tokenizer(path: str | os.PathLike | None):
    """The tokenizer kept beside the checkpoint at ``path``, or None when there is no checkpoint."""
    if path is None or not Path(path).is_file() or not _tokenizer_dir(path).is_dir():
        return None
    return AutoTokenizer.from_pretrained(str(_tokenizer_dir(path)), local_files_only=True)


def keep_tokenizer(path: str | os.PathLike | None, tokenizer) -> None:
    """Save the run's own tokenizer beside its future checkpoint at ``path`` (nothing without one)."""
    if path is not None:
        tokenizer.save_pretrained(str(_tokenizer_dir(path)))


def remove(path: str | os.PathLike | None) -> None:
    """Delete the checkpoint of a run that has finished, and its tokenizer."""
    if path is not None:
        Path(path).unlink(missing_ok=True)
        shutil.rmtree(_tokenizer_dir(path), ignore_errors=True)
