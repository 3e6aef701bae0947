"""OpenAI Batch output files for ``fleetbatch loadgen submit --openai-out``: the results of a batch as the
``openai`` client and other tools read them.

The line format (and its description) is :mod:`gateway.http_api.format`, shared with the gateway's
HTTP front; this module writes the output file and, beside it, the error file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

from gateway.http_api.format import output_line


def error_path(output: str | Path) -> Path:
    p = Path(output)
    return p.with_name(p.stem + "_errors" + (p.suffix or ".jsonl"))


class OpenAIOutput:
    """The output file and, beside it, the error file of a batch, written a result at a time as results come
    (``endpoint`` and ``model``: a result's request url and the model it named, by its ``custom_id``; a request
    that named none is answered as :data:`gateway.http_api.format.DEFAULT_MODEL`); ``ok`` and ``bad`` count the
    lines."""

    def __init__(
        self, output: str | Path, endpoint: Callable[[str], str], model: Callable[[str], str] = lambda _: ""
    ) -> None:
        self.endpoint, self.model, self.ok, self.bad = endpoint, model, 0, 0
        self._out = open(output, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._err = open(error_path(output), "w", encoding="utf-8")  # noqa: SIM115

    def write(self, r: Mapping) -> None:
        custom_id = str(r["query_id"])
        line = output_line(r, self.endpoint(custom_id), self.model(custom_id))
        (self._err if line["error"] else self._out).write(json.dumps(line, ensure_ascii=False) + "\n")
        self.ok, self.bad = (self.ok, self.bad + 1) if line["error"] else (self.ok + 1, self.bad)

    def close(self) -> None:
        self._out.close()
        self._err.close()
