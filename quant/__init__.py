"""Mixed-precision weight-only quantization, exact memory accounting, sensitivity indicator and
KV-cache quantization for fleetbatch (see ``docs/design/quant.md``)."""

from quant.accounting import (
    decoder_layer_weight_bytes,
    kv_bytes_per_token,
    layer_linear_shapes,
    packed_linear_bytes,
)

__all__ = [
    "decoder_layer_weight_bytes",
    "kv_bytes_per_token",
    "layer_linear_shapes",
    "packed_linear_bytes",
]
