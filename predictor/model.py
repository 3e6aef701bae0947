"""The classifier: ``DistilBertForSequenceClassification`` from a local checkpoint or built from a config.

Production path: a pretrained DistilBERT directory (``from_pretrained``, local files only)
with its own tokenizer and a fresh classification head over the buckets. Offline default:
a small config with random weights and a WordPiece tokenizer trained here on the prompts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    PreTrainedTokenizerFast,
)

log = logging.getLogger(__name__)

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@dataclass(frozen=True)
class ModelConfig:
    """Size of a DistilBERT built from scratch (DistilBERT-base is layers=6, dim=768, heads=12)."""

    layers: int = 4
    dim: int = 256
    heads: int = 4
    max_len: int = 128
    vocab_size: int = 8000
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.layers < 1 or self.dim < 8 or self.heads < 1 or self.max_len < 8 or self.vocab_size < 100:
            raise ValueError(f"model config out of range: {self}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")

    def to_dict(self) -> dict:
        return asdict(self)


QUICK = ModelConfig(layers=2, dim=128, heads=4, max_len=64, vocab_size=6000)
DEFAULT = ModelConfig()


def train_wordpiece(texts: Iterable[str], vocab_size: int = 8000) -> PreTrainedTokenizerFast:
    """A lower-casing BERT-style WordPiece tokenizer trained on ``texts`` (``[CLS] text [SEP]``)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer numbers tied tokens in a run-dependent order; renumber them (special tokens
    # first, then sorted) so that the same learnt vocabulary always gets the same ids.
    learnt = tok.get_vocab()
    order = SPECIAL + sorted(t for t in learnt if t not in SPECIAL)
    tok.model = models.WordPiece({t: i for i, t in enumerate(order)}, unk_token="[UNK]")
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "attention_mask"],
    )


def build_classifier(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast, num_labels: int, seed: int = 0
) -> DistilBertForSequenceClassification:
    """A randomly initialised (seeded) DistilBERT classifier of size ``cfg``."""
    torch.manual_seed(seed)
    config = DistilBertConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max(cfg.max_len, 512),
        n_layers=cfg.layers,
        n_heads=cfg.heads,
        dim=cfg.dim,
        hidden_dim=4 * cfg.dim,
        dropout=cfg.dropout,
        attention_dropout=cfg.dropout,
        seq_classif_dropout=cfg.dropout,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=num_labels,
    )
    return DistilBertForSequenceClassification(config)


def load_pretrained(
    path: str | os.PathLike, num_labels: int
) -> tuple[DistilBertForSequenceClassification, PreTrainedTokenizerFast]:
    """A local pretrained DistilBERT checkpoint with a new ``num_labels`` head (no downloads)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is not a Hugging Face model directory (no config.json)")
    tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    model = DistilBertForSequenceClassification.from_pretrained(
        str(p), num_labels=num_labels, local_files_only=True, ignore_mismatched_sizes=True
    )
    log.info("loaded pretrained DistilBERT from %s with a %d-bucket head", p, num_labels)
    return model, tok
