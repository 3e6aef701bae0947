"""Export a DistilBERT bucket classifier to ONNX for the fast serving path (:mod:`predictor.fastpath`).

Export time only (torch, onnx; ``pip install 'fleetbatch[onnx]'``). The graph computes the same
logits as ``DistilBertForSequenceClassification`` in eval mode, with one exact shortcut: the
classifier reads only the ``[CLS]`` position of the last layer, so that layer computes keys and values
for every token but its query, attention output, feed-forward and layer norms for ``[CLS]`` alone
(a 2-layer member then costs about 0.6 of its full forward). Inputs ``input_ids`` and
``attention_mask`` ``(batch, seq)`` int64 with dynamic axes; output ``logits`` ``(batch, buckets)``.
:func:`quantize` writes the dynamic int8 copy (weights int8 per channel, activations quantized at run
time).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

OPSET = 17
INPUTS = ("input_ids", "attention_mask")
OUTPUT = "logits"
_MASKED = -1e9  # added to the attention score of a padding token


class ClsGraph(nn.Module):
    """A DistilBERT classifier's eval-mode forward, the last layer cut to the ``[CLS]`` row (see the module doc)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if getattr(model.config, "model_type", None) != "distilbert":
            raise ValueError(f"the fast path exports DistilBERT classifiers, not {type(model).__name__}")
        if getattr(model.config, "sinusoidal_pos_embds", False):
            raise ValueError("the fast path exports learned position embeddings only")
        self.model = model
        self.heads = int(model.config.n_heads)

    def _attention(
        self, layer: nn.Module, h: torch.Tensor, q_in: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """One transformer block whose queries (and output rows) are ``q_in``'s, keys and values ``h``'s."""
        att = layer.attention
        b, s, d = h.shape
        hd = d // self.heads
        q = att.q_lin(q_in).view(b, -1, self.heads, hd).transpose(1, 2)
        k = att.k_lin(h).view(b, s, self.heads, hd).transpose(1, 2)
        v = att.v_lin(h).view(b, s, self.heads, hd).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) * (hd**-0.5) + bias
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, -1, d)
        x = layer.sa_layer_norm(att.out_lin(ctx) + q_in)
        ffn = layer.ffn
        return layer.output_layer_norm(ffn.lin2(ffn.activation(ffn.lin1(x))) + x)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        emb = self.model.distilbert.embeddings
        s = input_ids.shape[1]
        pos = torch.arange(s, dtype=torch.long, device=input_ids.device).unsqueeze(0)
        h = emb.LayerNorm(emb.word_embeddings(input_ids) + emb.position_embeddings(pos))
        bias = ((1.0 - attention_mask.to(h.dtype)) * _MASKED)[:, None, None, :]
        layers = list(self.model.distilbert.transformer.layer)
        for layer in layers[:-1]:
            h = self._attention(layer, h, h, bias)
        cls = self._attention(layers[-1], h, h[:, :1], bias)[:, 0]
        pooled = torch.relu(self.model.pre_classifier(cls))
        return self.model.classifier(pooled)


def export(model: nn.Module, path: str | Path, example_len: int = 16) -> Path:
    """Write ``model``'s :class:`ClsGraph` as ONNX at ``path`` (the TorchScript exporter, dynamic batch
    and sequence axes); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    was_training = model.training
    graph = ClsGraph(model).float().eval()  # the exporter restores the graph's mode, and so its model's
    ids = torch.ones((2, example_len), dtype=torch.long)
    mask = torch.ones((2, example_len), dtype=torch.long)
    axes = {
        "input_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "seq"},
        OUTPUT: {0: "batch"},
    }
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            graph,
            (ids, mask),
            str(path),
            input_names=list(INPUTS),
            output_names=[OUTPUT],
            dynamic_axes=axes,
            opset_version=OPSET,
            dynamo=False,
        )
    model.train(was_training)
    return path


def quantize(src: str | Path, dest: str | Path, per_channel: bool = True) -> Path:
    """Dynamic int8 quantization of the ONNX model ``src`` into ``dest`` (onnxruntime's
    ``quantize_dynamic``: int8 weights of every MatMul/Gemm, activations quantized at run time)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the quantizer logs every tensor it leaves alone on the root logger
    try:
        quantize_dynamic(
            str(src),
            str(dest),
            weight_type=QuantType.QInt8,
            per_channel=per_channel,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    finally:
        logging.disable(previous)
    return Path(dest)
