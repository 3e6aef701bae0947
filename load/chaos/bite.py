"""Evidence that a ``fleetbatch loadgen chaos`` fault took effect (it *bit*), and the probes that gather it.

A fault is counted injected only when its :class:`Bite` holds evidence and no reason it
``missed``: a SIGKILL of an engine that held no lease, a Redis that still answered pings, a
partition no connection went through, proves nothing about recovery. ``healed_at`` is the
moment the fault healed (Redis started, proxy healed, SIGCONT sent, the process restarted...),
taken inside the fault: the run measures ``recovery_s`` from there.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import redis


@dataclass
class Bite:
    """What one fault did: ``evidence`` that it bit, or why it did not (``missed``)."""

    evidence: dict = field(default_factory=dict)
    missed: str = ""
    healed_at: float | None = None  # time.monotonic() when the fault healed
    confirm: Callable[[], str] | None = None  # checked once the run settled: "" or why it did not bite

    @property
    def bit(self) -> bool:
        return not self.missed

    def miss(self, why: str) -> Bite:
        self.missed = self.missed or why
        return self


def redis_down(url: str) -> bool:
    """Whether a fresh client's ``PING`` to ``url`` fails."""
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        client.ping()
        return False
    except (redis.RedisError, OSError):
        return True
    finally:
        client.close()


class DownProbe:
    """Pings Redis on each :meth:`poll` and keeps the span over which the pings failed."""

    def __init__(self, url: str):
        self.url = url
        self.failed = 0
        self.first: float | None = None
        self.last: float | None = None

    def poll(self) -> None:
        if redis_down(self.url):
            now = time.monotonic()
            self.failed += 1
            self.first = now if self.first is None else self.first
            self.last = now

    @property
    def down_s(self) -> float:
        """Seconds between the first and the last failed ping."""
        return round(self.last - self.first, 2) if self.first is not None and self.last is not None else 0.0


#: what an engine logs when one of its Redis calls fails (engines/worker.py)
REDIS_TROUBLE = re.compile(r"Redis unavailable|heartbeat failed|could not give queries back")


class LogWatch:
    """Lines the engines log from now on: ``saw(pattern)`` names the engines that logged a match."""

    def __init__(self, log_dir: Path, names: Iterable[str]):
        self.paths = {n: log_dir / f"engine-{n}.log" for n in names}
        self.offsets = {n: (p.stat().st_size if p.exists() else 0) for n, p in self.paths.items()}

    def saw(self, pattern: re.Pattern = REDIS_TROUBLE) -> list[str]:
        out = []
        for name, path in self.paths.items():
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets[name])
                text = f.read().decode("utf-8", "replace")
            if pattern.search(text):
                out.append(name)
        return out
