"""The classifier over length buckets, built from a config or from a local pretrained encoder.

Default: a small ``DistilBertForSequenceClassification`` with random weights (optionally MLM
pre-trained here) and a WordPiece tokenizer trained here on the prompts. ``--pretrained DIR``: any
local Hugging Face encoder checkpoint (BERT, DistilBERT, MiniLM, ...; ``AutoModel`` and
``AutoTokenizer``, local files only) under :class:`MeanPoolClassifier`, a mean-pooled bucket head.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModel,
    AutoTokenizer,
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    get_linear_schedule_with_warmup,
)
from transformers.modeling_outputs import SequenceClassifierOutput

from predictor.inference import collate, encode

log = logging.getLogger(__name__)

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@dataclass(frozen=True)
class ModelConfig:
    """Size of a DistilBERT built from scratch (DistilBERT-base is layers=6, dim=768, heads=12)."""

    layers: int = 2
    dim: int = 128
    heads: int = 4
    max_len: int = 96
    vocab_size: int = 6000
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.layers < 1 or self.dim < 8 or self.heads < 1 or self.max_len < 8 or self.vocab_size < 100:
            raise ValueError(f"model config out of range: {self}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")

    def to_dict(self) -> dict:
        return asdict(self)


# DEFAULT: the measured recipe (docs/BENCHMARKS.md), within the 4.5 ms/query budget on 2 CPU cores;
# 4 x 256 at 128 tokens costs about 20 ms/query there, and 4 x 128 ranked no better than 2 x 128.
DEFAULT = ModelConfig()
QUICK = ModelConfig(max_len=64)


def train_wordpiece(texts: Iterable[str], vocab_size: int = 8000) -> PreTrainedTokenizerFast:
    """A lower-casing BERT-style WordPiece tokenizer trained on ``texts`` (``[CLS] text [SEP]``)."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer numbers tied tokens in a run-dependent order; renumber them (special tokens
    # first, then sorted) so that the same learnt vocabulary always gets the same ids. (Which tokens
    # are learnt can itself differ between runs on small corpora: the trainer breaks tied merge
    # counts in hash order, tokenizers issue 1794; a saved tokenizer is what makes a model repeatable.)
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


def distilbert_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast, **extra) -> DistilBertConfig:
    """The DistilBERT config of size ``cfg`` over ``tokenizer``'s vocabulary (shared by classifier and MLM)."""
    return DistilBertConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max(cfg.max_len, 512),
        n_layers=cfg.layers,
        n_heads=cfg.heads,
        dim=cfg.dim,
        hidden_dim=4 * cfg.dim,
        dropout=cfg.dropout,
        attention_dropout=cfg.dropout,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def build_classifier(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast, num_labels: int, seed: int = 0
) -> DistilBertForSequenceClassification:
    """A randomly initialised (seeded) DistilBERT classifier of size ``cfg``."""
    torch.manual_seed(seed)
    config = distilbert_config(
        cfg,
        tokenizer,
        seq_classif_dropout=cfg.dropout,
        num_labels=num_labels,
    )
    return DistilBertForSequenceClassification(config)


def pretrain_mlm(
    cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerFast,
    texts: list[str],
    epochs: float = 5.0,
    lr: float = 1e-3,
    batch_size: int = 64,
    mask_prob: float = 0.15,
    truncation: str = "head_tail",
    seed: int = 0,
    device: str = "cpu",
    max_minutes: float | None = None,
) -> dict:
    """Masked-language-model pre-training of a from-scratch DistilBERT on ``texts`` (the training prompts).

    MICO fine-tunes a pretrained DistilBERT; offline there is none, so this gives the encoder the
    same kind of start on the only text at hand. BERT's masking: ``mask_prob`` of the non-special
    tokens are predicted, 80% of them replaced by ``[MASK]``, 10% by a random token, 10% kept.
    Returns the encoder weights (``distilbert.*`` keys) for :func:`build_classifier`'s model.
    """
    torch.manual_seed(seed)
    config = distilbert_config(cfg, tokenizer)
    mlm = DistilBertForMaskedLM(config).to(device)
    ids = [x for x in encode(tokenizer, texts, cfg.max_len, truncation) if len(x) > 2]
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), device=device)
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    steps_per_epoch = math.ceil(len(ids) / batch_size)
    total = max(1, math.ceil(epochs * steps_per_epoch))
    opt = torch.optim.AdamW(mlm.parameters(), lr=lr, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, int(0.06 * total), total)
    mlm.train()
    started, order, pos, losses = time.monotonic(), rng.permutation(len(ids)), 0, []
    for step in range(total):
        if pos >= len(order):
            order, pos = rng.permutation(len(ids)), 0
        idx = order[pos : pos + batch_size]
        pos += batch_size
        input_ids, mask = collate([ids[i] for i in idx], tokenizer.pad_token_id)
        input_ids, mask = input_ids.to(device), mask.to(device)
        can = (mask == 1) & ~torch.isin(input_ids, special)
        r = torch.rand(input_ids.shape, generator=gen, device=device)
        chosen = can & (r < mask_prob)
        labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
        how = torch.rand(input_ids.shape, generator=gen, device=device)
        masked = input_ids.clone()
        masked[chosen & (how < 0.8)] = tokenizer.mask_token_id
        rand_pos = chosen & (how >= 0.8) & (how < 0.9)
        masked[rand_pos] = torch.randint(len(tokenizer), (int(rand_pos.sum()),), generator=gen, device=device)
        # the vocabulary projection only at the masked positions (most of the cost otherwise)
        hidden = mlm.distilbert(input_ids=masked, attention_mask=mask)[0][chosen]
        logits = mlm.vocab_projector(mlm.vocab_layer_norm(mlm.activation(mlm.vocab_transform(hidden))))
        loss = torch.nn.functional.cross_entropy(logits, labels[chosen])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mlm.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % steps_per_epoch == 0 or step + 1 == total:
            log.info("MLM step %d/%d: loss %.3f", step + 1, total, float(np.mean(losses)))
            losses = []
        if max_minutes is not None and time.monotonic() - started > 60 * max_minutes:
            log.info("MLM pre-training stopped at step %d: time cap of %.1f minutes", step + 1, max_minutes)
            break
    return {k: v.detach().cpu() for k, v in mlm.state_dict().items() if k.startswith("distilbert.")}


#: set in the config.json of a :class:`MeanPoolClassifier` (the encoder's own config, saved by it)
POOLING_KEY = "fleetbatch_pooling"
#: the bucket head's weights, beside the encoder's in a saved :class:`MeanPoolClassifier`
HEAD_FILE = "bucket_head.safetensors"


class MeanPoolClassifier(torch.nn.Module):
    """A Hugging Face encoder (any ``AutoModel``), mean pooling over the prompt's tokens, and a linear
    head over the buckets; the forward pass returns ``.logits`` like ``*ForSequenceClassification``.

    The encoder sits under its ``base_model_prefix`` (``model.bert``, ``model.distilbert``), as in
    the Hugging Face heads. Saved as the encoder's own directory (``config.json`` with
    ``num_labels`` and ``fleetbatch_pooling``) plus ``bucket_head.safetensors``.
    """

    def __init__(self, encoder: PreTrainedModel, num_labels: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.config = encoder.config
        self.config.num_labels = num_labels
        setattr(self.config, POOLING_KEY, "mean")
        self.encoder_name = encoder.base_model_prefix
        self.add_module(self.encoder_name, encoder)
        self.dropout = torch.nn.Dropout(dropout)
        self.classifier = torch.nn.Linear(self.config.hidden_size, num_labels)
        std = getattr(self.config, "initializer_range", 0.02)
        torch.nn.init.normal_(self.classifier.weight, std=std)
        torch.nn.init.zeros_(self.classifier.bias)

    @property
    def encoder(self) -> PreTrainedModel:
        return getattr(self, self.encoder_name)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SequenceClassifierOutput:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return SequenceClassifierOutput(logits=self.classifier(self.dropout(pooled)))

    def save_pretrained(self, path: str | os.PathLike, **kwargs) -> None:
        self.encoder.save_pretrained(str(path), **kwargs)
        head = {k: v.detach().contiguous().cpu() for k, v in self.classifier.state_dict().items()}
        save_file(head, str(Path(path) / HEAD_FILE))

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32
    ) -> MeanPoolClassifier:
        """A saved classifier (encoder directory with ``bucket_head.safetensors``), local files only."""
        encoder = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        head = load_file(str(Path(path) / HEAD_FILE))
        model = cls(encoder, head["weight"].shape[0])
        model.classifier.load_state_dict({k: v.to(dtype) for k, v in head.items()})
        return model


def _check_model_dir(p: Path) -> None:
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is not a Hugging Face model directory (no config.json)")


def load_pretrained(
    path: str | os.PathLike, num_labels: int
) -> tuple[MeanPoolClassifier, PreTrainedTokenizerFast]:
    """A local pretrained encoder checkpoint (BERT, DistilBERT, MiniLM, ...: whatever ``AutoModel``
    reads, with its tokenizer) under a new mean-pooled ``num_labels``-bucket head; no downloads."""
    p = Path(path)
    _check_model_dir(p)
    tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    encoder = AutoModel.from_pretrained(str(p), local_files_only=True, dtype=torch.float32)
    model = MeanPoolClassifier(encoder, num_labels)
    log.info(
        "loaded pretrained %s encoder from %s (%.1fM parameters) with a mean-pooled %d-bucket head",
        model.config.model_type,
        p,
        sum(x.numel() for x in encoder.parameters()) / 1e6,
        num_labels,
    )
    return model, tok


def load_classifier(path: str | os.PathLike) -> torch.nn.Module:
    """A saved bucket classifier in float32 (whatever the file holds; the shipped model is fp16): a
    :class:`MeanPoolClassifier` if its config says so, else ``DistilBertForSequenceClassification``."""
    p = Path(path)
    _check_model_dir(p)
    if getattr(AutoConfig.from_pretrained(str(p), local_files_only=True), POOLING_KEY, None) == "mean":
        return MeanPoolClassifier.from_pretrained(p)
    return DistilBertForSequenceClassification.from_pretrained(
        str(p), local_files_only=True, dtype=torch.float32
    )
