"""``fleetbatch predictor export``: write a dataset's labels (prompt, length in serving tokens, source, split) as JSONL."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from predictor.commands.common import splits
from predictor.labeled import split_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSONL file to write")


def run(args) -> dict:
    data, sp = splits(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for p, n, s in zip(data.prompts, data.lengths, data.sources, strict=True):
            f.write(json.dumps({"prompt": p, "length": int(n), "source": s, "split": split_of(p)}) + "\n")
    return {"out": str(out), "examples": len(data), **{k: len(v) for k, v in sp.items()}}
