"""The project's default tokenizer: a byte-level BPE trained on this machine (the shared datasets' text, or
generated text) and cached on disk. It needs ``tokenizers`` and transformers' tokenizer class only, not torch:
a gateway that counts prompt tokens with it starts without the model code (:mod:`localmodels.build`)."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from fleetdata.datasets import data_dir, load_mixed
from localmodels.paths import cache_dir

log = logging.getLogger(__name__)

SPECIAL = {"bos": "<s>", "eos": "</s>", "pad": "<pad>", "unk": "<unk>"}

_WORDS = (
    "the a of to and in is for on with as by at from that this it be are was an or which "
    "model data query batch cluster token time value number list write explain describe give "
    "how what why when where who make find show compute sum total step first second then "
    "answer question code function return string python array sort count loop error file "
    "story character scene plan idea reason result table name city river history science "
    "music energy water light market price cost day week year people school book letter email "
    "summary short long simple detailed example problem solution method test case"
).split()


def generated_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic synthetic text (word salad from a fixed vocabulary) for tokenizer training."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(5, 60)
        words = [rng.choice(_WORDS) for _ in range(k)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":"]))
    return out


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with ``<s>``, ``</s>``, ``<pad>``, ``<unk>`` special tokens."""
    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL["pad"], SPECIAL["bos"], SPECIAL["eos"], SPECIAL["unk"]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL['bos']} $A", special_tokens=[(SPECIAL["bos"], tok.token_to_id(SPECIAL["bos"]))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL["bos"],
        eos_token=SPECIAL["eos"],
        pad_token=SPECIAL["pad"],
        unk_token=SPECIAL["unk"],
        padding_side="left",
    )


def default_corpus() -> list[str]:
    """Text for the default tokenizer: the shared datasets' prompts and responses when present, else generated text."""
    try:
        records = load_mixed()
    except (FileNotFoundError, OSError):
        log.info("shared datasets not found; training the default tokenizer on generated text")
        return generated_corpus()
    return [t for r in records for t in (r.prompt, r.response) if t]


def _default_corpus_key() -> str:
    """A cheap fingerprint of what :func:`default_corpus` would return (file names and sizes)."""
    try:
        root = data_dir()
    except (FileNotFoundError, OSError):
        return "generated"
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return "data:" + ";".join(f"{p.relative_to(root)}={p.stat().st_size}" for p in files)


def default_tokenizer(vocab_size: int = 8192, texts: Sequence[str] | None = None) -> PreTrainedTokenizerFast:
    """The default tokenizer, trained once on ``texts`` (:func:`default_corpus` by default) and cached on disk."""
    digest = hashlib.sha1(str(vocab_size).encode())
    if texts is None:
        digest.update(_default_corpus_key().encode())
    else:
        texts = list(texts)
        for t in texts:
            digest.update(t.encode("utf-8", "replace"))
    path = cache_dir() / f"tokenizer-{digest.hexdigest()[:12]}"
    if (path / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    texts = texts if texts is not None else default_corpus()
    log.info("training a %d-token BPE tokenizer on %d texts -> %s", vocab_size, len(texts), path)
    tok = train_tokenizer(texts, vocab_size)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        tmp.rename(path)  # atomic: concurrent processes never see half a tokenizer
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(str(path))
