"""Every Redis key name is built by workqueue/keys.py: no other module of the project spells one.

The scan reads each module's syntax tree (docstrings and ``help=`` texts are prose, not keys) and
flags what spells a key: a string with the deployment's hash tag ``{fb}``, the key prefix or tag
used to build a name, a suffix glued onto a key (``keys.batch(b) + ":intake"``, ``key + ":lease"``),
and a Lua ``redis.call`` given a literal key instead of ``KEYS``, ``ARGV`` or a builder of keys.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from workqueue import keys

ROOT = Path(__file__).resolve().parents[1]
KEYS_MODULE = ROOT / "workqueue" / "keys.py"
# a Lua call whose first argument after the command is a quoted literal: a key spelled in the script
LUA_LITERAL_KEY = re.compile(r"redis\.call\(\s*'[A-Za-z]+'\s*,\s*['\"]")
SUFFIX = re.compile(r"^:[A-Za-z][\w-]*")
KEY_WORDS = {"PREFIX", "TAG"}


def project_modules() -> list[Path]:
    packages = [p.parent for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"]
    return sorted(
        f for pkg in packages for f in pkg.rglob("*.py") if f != KEYS_MODULE and "_pb2" not in f.name
    )


def _prose(tree: ast.AST) -> set[int]:
    """ids of the string nodes that are documentation: docstrings and argparse ``help=`` texts."""
    out: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg == "help":
            out.update(id(n) for n in ast.walk(node.value))
    return out


def _is_suffix(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(SUFFIX.match(node.value))


def spelled_keys(source: str, name: str = "<source>") -> list[str]:
    """Where ``source`` spells a Redis key name (``line: what``); empty when it builds none itself."""
    tree = ast.parse(source, name)
    prose = _prose(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if keys.TAG in node.value:
                found.append(f"{line}: the hash tag {keys.TAG} in a string")
            if LUA_LITERAL_KEY.search(node.value):
                found.append(f"{line}: a Lua redis.call with a literal key")
        elif isinstance(node, ast.ImportFrom) and node.module == "workqueue.keys":
            found += [f"{line}: imports keys.{a.name}" for a in node.names if a.name in KEY_WORDS]
        elif isinstance(node, ast.Attribute) and node.attr in KEY_WORDS:
            if isinstance(node.value, ast.Name) and node.value.id == "keys":
                found.append(f"{line}: builds a name from keys.{node.attr}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            if _is_suffix(node.right) and not isinstance(node.left, ast.Constant):
                found.append(f"{line}: glues {node.right.value!r} onto a name")
        elif isinstance(node, ast.JoinedStr):
            parts = node.values
            for before, after in zip(parts, parts[1:], strict=False):
                if isinstance(before, ast.FormattedValue) and _is_suffix(after):
                    found.append(f"{line}: glues {after.value!r} onto a name in an f-string")
    return found


def test_no_module_but_keys_py_spells_a_redis_key():
    bad = {}
    for path in project_modules():
        found = spelled_keys(path.read_text(), str(path))
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, f"Redis key names spelled outside workqueue/keys.py (build them there): {bad}"


def test_the_scan_sees_each_way_of_spelling_a_key():
    spelled = [
        'LIST = "{fb}:oai:batches"',
        "from workqueue.keys import PREFIX",
        'def f(keys, b): return keys.PREFIX + "intake"',
        'def f(keys, b): return keys.batch(b) + ":intake"',
        'def f(key): return key + ":lease"',
        'def f(b): return f"{b}:staging:x"',
        "LUA = \"redis.call('GET', '{x}:mover')\"",
        "LUA = \"return redis.call('DEL', 'mover')\"",
    ]
    for source in spelled:
        assert spelled_keys(source), source
    clean = [
        '"""Keys such as {fb}:q:<gid> are documented here."""',
        'p.add_argument("--cluster", help="its queue is {fb}:c:NAME:queue")',
        "def f(keys, b): return keys.intake(b)",
        "LUA = \"return redis.call('GET', KEYS[1])\"",
        "LUA = \"redis.call('HGET', k_batch(bid), 'status')\"",
        'host = "127.0.0.1" + ":" + "50051"',
        'def f(c): return "left:" + c',
    ]
    for source in clean:
        assert not spelled_keys(source), source
