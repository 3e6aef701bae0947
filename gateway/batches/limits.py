"""A bound on the request bytes the gateway decodes and handles at once (``--max-inflight-mb``).

gRPC bounds one message (``--max-request-mb``) and the calls served at once
(``--max-concurrent-rpcs``); this bounds their sum. A request is counted from the moment its
bytes are decoded until its handler returns. One that would take the total past the limit is
not decoded: it answers ``RESOURCE_EXHAUSTED`` (retry later; :mod:`gateway.grpc_api.inflight`), so a few clients sending the
largest batches at once cannot make the gateway hold many decoded copies of them. A request
larger than the whole limit is still served when nothing else is in flight. The HTTP front's
batch creations are counted in the same budget, as their input file's bytes (:class:`gateway.http_api.front.OpenAIFront`).
"""

from __future__ import annotations

import threading


class InflightBytes:
    """A counter of bytes in flight with a limit (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def acquire(self, n: int) -> bool:
        with self._lock:
            if self.used > 0 and self.used + n > self.limit:
                return False
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n

    def refusal(self, n: int) -> str:
        """What a request of ``n`` bytes that did not fit is told."""
        return (
            f"the gateway is handling {self.used} request bytes (limit {self.limit}, "
            f"--max-inflight-mb); this request has {n}: retry later"
        )
