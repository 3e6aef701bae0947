"""``fleetbatch gateway redis-acl``: the Redis ACL file's line for one user of a role (a cloud's engines, a gateway).

An engine in another cloud reaches the home Redis as an ACL user of its own, allowed only what a worker
sends and only the deployment's keys (:mod:`workqueue.acl`, the one list of each role's commands). This
prints ``user NAME reset on #<sha256> resetchannels ~{fb}:* &{fb}:* -@all +...`` for the server's
``aclfile`` (or, after ``user NAME``, the rules of ``redis-cli ACL SETUSER NAME ...``). The password is
read from ``--password-file`` (else the first line of stdin) and printed only as its SHA-256: the
client gets it in its URL, ``rediss://NAME:PASSWORD@HOST:PORT/0``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workqueue.acl import ROLES, acl_line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``fleetbatch gateway redis-acl``'s options."""
    p.add_argument("--user", required=True, help="the ACL user's name (one per cloud, e.g. engines-aws)")
    p.add_argument(
        "--role",
        required=True,
        choices=sorted(ROLES),
        help="what the user runs: a cloud's engines or a gateway",
    )
    p.add_argument(
        "--password-file",
        default=None,
        metavar="FILE",
        help="file whose first line is the user's password (default: the first line of stdin)",
    )


def password(path: str | None) -> str:
    """The first line of ``path`` (of stdin without one), its line end dropped."""
    if path is None:
        text = sys.stdin.readline()
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"--password-file {path}: no such file")
        text = file.read_text().partition("\n")[0]
    text = text.rstrip("\r\n")
    if not text:
        raise ValueError(f"the password ({path or 'stdin'}) is empty")
    return text


def run(args: argparse.Namespace) -> str:
    """The ACL file's line for ``--user`` in ``--role``."""
    return acl_line(args.user, args.role, password(args.password_file))
