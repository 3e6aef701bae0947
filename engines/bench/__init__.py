"""The engine's tooling, apart from what runs in production: ``fleetbatch engine bench`` (static batches vs HF
continuous batching vs this engine: :mod:`.compare`; pipeline stages: :mod:`.pipeline`; the prefix
cache: :mod:`.prefix`), ``fleetbatch engine profile`` (:mod:`.profile`) and the GPU check behind
``scripts/gpu-check.sh`` (:mod:`.gpu_check`). The runtime modules of :mod:`engines` never import
this package (an import contract in ``pyproject.toml``); only ``engines.cli`` does."""
