"""A stand-in engine for the fork-server tests: ``main([path])`` starts one process as a pipeline starts its
stages (the ``forkserver`` context); that process writes, as JSON to ``path``, its parent (the fork server that
forked it), that server's parent and command line, and the log line it printed goes to the engine's log."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path


def _report(path: str) -> None:
    server = os.getppid()
    with open(f"/proc/{server}/stat") as f:
        server_parent = int(f.read().rsplit(")", 1)[1].split()[1])
    cmdline = Path(f"/proc/{server}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    print(f"stage {os.getpid()} here", flush=True)
    Path(path).write_text(json.dumps({"server": server, "server_parent": server_parent, "cmdline": cmdline}))


def main(argv: list[str]) -> int:
    ctx = mp.get_context("forkserver")
    p = ctx.Process(target=_report, args=(argv[0],))
    p.start()
    p.join(30)
    return p.exitcode if p.exitcode is not None else 1
