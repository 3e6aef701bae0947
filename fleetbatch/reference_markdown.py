"""Markdown for the generated reference pages (:mod:`fleetbatch.reference`, :mod:`fleetbatch.reference_schemas`):
a page's header, escaped text, code spans, tables and links to headings, one way for every page."""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence


def header(title: str, source: str, intro: str) -> str:
    note = f"<!-- Generated from {source} by `python -m fleetbatch.reference`: do not edit by hand. -->"
    return f"{note}\n\n# {title}\n\n{intro}\n\n"


def text(text: str) -> str:
    """Plain text for a Markdown paragraph or table cell: one line; ``code`` spans kept, the rest escaped."""
    parts = " ".join(text.split()).split("`")
    if len(parts) % 2 == 0:  # an unpaired backquote: no code spans
        parts = ["`".join(parts)]
    escape = re.compile(r"[\\*\[|`]|(?<!\w)_|_(?!\w)")  # what would start emphasis, a link, code or a cell
    return "".join(
        code(p) if i % 2 else html.escape(escape.sub(lambda m: "\\" + m.group(0), p), quote=False)
        for i, p in enumerate(parts)
    )


def code(text: str) -> str:
    """A code span that survives a table cell (a ``|`` in a code span ends the cell on some renderers)."""
    if "|" in text or "`" in text:
        return "<code>" + html.escape(text, quote=False).replace("|", "&#124;") + "</code>"
    return f"`{text}`"


def table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cell or " " for cell in row) + " |" for row in rows]) + "\n\n"


def link(name: str) -> str:
    """A link to this page's heading ``name``, by the anchor MkDocs gives it (the ``toc`` extension's rule)."""
    anchor = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", name).strip().lower())
    return f"[`{name}`](#{anchor})"
