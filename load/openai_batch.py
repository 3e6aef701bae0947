"""OpenAI Batch output: the results of a batch as the ``openai`` client and other tools read them.

The line format and the input parsing are :mod:`gateway.openai_format` (shared with the
gateway's HTTP front); this module writes the files of ``loadgen submit --openai-out``.

One line per request. A request that succeeded has ``response`` (``status_code`` 200,
``request_id`` and a ``body``: a ``chat.completion`` for ``/v1/chat/completions``, a
``text_completion`` for ``/v1/completions``, with ``choices`` and ``usage``) and ``error`` null;
it goes to the output file. A request that failed or was cancelled has ``response`` null and
``error`` (``code``, ``message``) and goes to the error file, as OpenAI's batches do.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

# the pure part lives in the gateway, which serves the same files over HTTP; re-exported here
from gateway.openai_format import (  # noqa: F401
    ACCEPTED,
    CHAT,
    COMPLETIONS,
    DEFAULT_TEMPLATE,
    ENDPOINTS,
    GENERATION_PROMPT,
    check_body,
    output_line,
    render_chat,
)


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
