"""OpenAI Batch output files for ``loadgen submit --openai-out``: the results of a batch as the
``openai`` client and other tools read them.

The line format (and its description) is :mod:`gateway.http_api.format`, shared with the gateway's
HTTP front; this module writes the output file and, beside it, the error file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from gateway.http_api.format import CHAT, output_line


def endpoints_of(input_path: str | Path) -> dict[str, str]:
    """``custom_id -> url`` of an OpenAI batch input file (``/v1/chat/completions`` when absent)."""
    out = {}
    for line in Path(input_path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out[str(row["custom_id"])] = row.get("url") or CHAT
    return out


def error_path(output: str | Path) -> Path:
    p = Path(output)
    return p.with_name(p.stem + "_errors" + (p.suffix or ".jsonl"))


def write_openai_output(
    results: Iterable[Mapping], endpoints: Mapping[str, str], output: str | Path, model: str = "fleetbatch"
) -> tuple[int, int]:
    """Write the output and error files; returns (lines written to each)."""
    ok, bad = 0, 0
    with open(output, "w", encoding="utf-8") as out, open(error_path(output), "w", encoding="utf-8") as err:
        for r in results:
            line = output_line(r, endpoints.get(str(r["query_id"]), CHAT), model)
            target = err if line["error"] else out
            target.write(json.dumps(line, ensure_ascii=False) + "\n")
            ok, bad = (ok, bad + 1) if line["error"] else (ok + 1, bad)
    return ok, bad
