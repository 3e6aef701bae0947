"""The Lua scripts' shared functions, from one source: each script gets only the functions it uses.

A :class:`Library` holds named Lua definitions (``local function name(...)`` or ``local NAME = ...``,
with the comment lines above each), in an order where each one uses only those before it.
:meth:`Library.script` puts in front of a script's body the definitions the body uses, and those
they use in turn, in library order: nothing else. The definitions come from the modules that own
their rules (key builders from :mod:`workqueue.keys`, ``rank`` from :mod:`workqueue.ordering`, the
lease from :mod:`workqueue.lease`, the queue's from :mod:`workqueue.lua_queue`); a module with
functions of its own (the moves', the upgrade's) extends the library with :meth:`Library.extended`.

**Why generated sections and not Redis 7 Functions.** The embedded server (Redis 7.0) and Redis
Cluster do carry ``FUNCTION LOAD``, but a function library is state the server keeps: it has to be
loaded on every primary of a cluster, it survives a restart only with persistence, and one library
name holds one version, so during a rolling upgrade the replica that loads last replaces the
functions the others still call. Scripts sent by ``EVALSHA`` are addressed by their content: old
and new versions run side by side, a Redis that lost them (restart, failover) answers ``NOSCRIPT``
and gets them again (:mod:`workqueue.script_call`), and a managed Redis without ``FUNCTION`` works.
So the scripts stay ``EVALSHA`` scripts, and only their shared text is generated from one source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DEFINES = re.compile(r"^local\s+(?:function\s+)?([A-Za-z_]\w*)\s*[(=]")
_NAME = re.compile(r"[A-Za-z_]\w*")


def code_of(lua: str) -> str:
    """``lua`` without its comments and the contents of its quoted strings."""
    out, i, n = [], 0, len(lua)
    while i < n:
        ch = lua[i]
        if lua.startswith("--", i):
            i = lua.find("\n", i)
            i = n if i < 0 else i
        elif ch in "'\"":
            i += 1
            while i < n and lua[i] != ch:
                i += 2 if lua[i] == "\\" else 1
            i += 1
            out.append(" ")
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def names_in(lua: str) -> set[str]:
    """The identifiers ``lua``'s code mentions (not its comments or strings)."""
    return set(_NAME.findall(code_of(lua)))


@dataclass(frozen=True)
class Definition:
    """One named Lua definition: its source (with the comment lines above it) and the definitions it uses."""

    name: str
    source: str
    uses: frozenset[str]


def parse(lua: str) -> list[tuple[str, str]]:
    """``(name, source)`` of each top-level ``local`` definition of ``lua``, in order; the comment
    lines right above a definition are part of its source."""
    out: list[tuple[str, list[str]]] = []
    comments: list[str] = []
    for line in lua.splitlines():
        m = _DEFINES.match(line)
        if m:
            out.append((m.group(1), [*comments, line]))
            comments = []
        elif line.startswith("--"):
            comments.append(line)
        elif line.strip():
            if not out:
                raise ValueError(f"Lua outside a definition: {line!r}")
            out[-1][1].extend([*comments, line])
            comments = []
    return [(name, "\n".join(lines) + "\n") for name, lines in out]


class Library:
    """Named Lua definitions, each using only earlier ones; :meth:`script` composes a script from them."""

    def __init__(self, *sources: str, header: str = "") -> None:
        self.header = header
        self.definitions: dict[str, Definition] = {}
        for source in sources:
            self._add(source)

    def _add(self, source: str) -> None:
        parsed = parse(source)
        for name, text in parsed:
            if name in self.definitions:
                raise ValueError(f"Lua function {name} is defined twice")
            mentioned = names_in(text) - {name}
            later = (mentioned & {n for n, _ in parsed}) - set(self.definitions)
            if later:
                raise ValueError(f"Lua function {name} uses {sorted(later)}, defined after it")
            self.definitions[name] = Definition(name, text, frozenset(mentioned & set(self.definitions)))

    def extended(self, *sources: str) -> Library:
        """This library with more definitions after its own (which they may use)."""
        out = Library(header=self.header)
        out.definitions = dict(self.definitions)
        for source in sources:
            out._add(source)
        return out

    def needed(self, body: str) -> list[str]:
        """The names of the definitions ``body`` uses, directly or through others, in library order."""
        todo = [n for n in names_in(body) if n in self.definitions]
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(self.definitions[name].uses)
        return [n for n in self.definitions if n in seen]

    def script(self, body: str) -> str:
        """The script: the header, the definitions ``body`` needs (:meth:`needed`), then ``body``."""
        return self.header + "".join(self.definitions[n].source for n in self.needed(body)) + body
