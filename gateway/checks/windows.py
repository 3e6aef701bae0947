"""Completion windows and priorities as clients write them: one parser for the gRPC and HTTP fronts.

A window is a duration: one or more ``<number><unit>`` parts, units ``d``, ``h``, ``m``, ``s``
(``"24h"``, ``"30m"``, ``"90m"``, ``"1h30m"``, ``"2d"``, ``"45s"``), from :data:`MIN_WINDOW_S` to
:data:`MAX_WINDOW_S`. An empty window is OpenAI's default, ``24h`` (the only value OpenAI accepts;
the others are this gateway's extension). Seconds are accepted for tests and benchmarks; real
batches use minutes to days. A priority is an integer from -100 to 100 (0 by default): see
:mod:`workqueue.ordering`.
"""

from __future__ import annotations

import math
import re

DEFAULT_WINDOW = "24h"
MIN_WINDOW_S = 1.0
MAX_WINDOW_S = 30 * 86400.0
MIN_PRIORITY, MAX_PRIORITY = -100, 100
UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")


class WindowError(ValueError):
    """A window or priority the gateway refuses (its message names the field and the rule)."""


def parse_window(text: str | None) -> float:
    """Seconds of a completion window (``None`` or ``""``: the default, 24 h)."""
    raw = DEFAULT_WINDOW if text in (None, "") else text
    if not isinstance(raw, str):
        raise WindowError(f"completion_window must be a string such as '24h', not {raw!r}")
    s = raw.strip().lower()
    parts = _PART.findall(s)
    if not parts or "".join(n + u for n, u in parts) != s:
        raise WindowError(
            f"completion_window {raw!r} is not a duration: use parts such as '24h', '30m', '1h30m', '2d'"
        )
    seconds = sum(float(n) * UNITS[u] for n, u in parts)
    if not (math.isfinite(seconds) and MIN_WINDOW_S <= seconds <= MAX_WINDOW_S):
        raise WindowError(
            f"completion_window {raw!r} must be between {MIN_WINDOW_S:.0f} s and {MAX_WINDOW_S / 86400:.0f} days"
        )
    return seconds


def format_window(seconds: float) -> str:
    """A window's canonical text (the largest units that add up exactly): 86400 -> ``24h``, 5400 -> ``1h30m``."""
    if seconds <= 0:
        return ""
    left, out = round(seconds), []
    if left % 86400 == 0 and left >= 86400 * 2:
        return f"{left // 86400}d"
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            out.append(f"{left // size}{unit}")
            left %= size
    return "".join(out) or "0s"


def check_priority(value: int) -> int:
    if not (MIN_PRIORITY <= value <= MAX_PRIORITY):
        raise WindowError(f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}, not {value}")
    return value
