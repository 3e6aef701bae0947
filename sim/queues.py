"""A cluster's queue in the simulator, ordered as the real one is (:mod:`workqueue.ordering`).

Queries wait in *lanes*, one per order key (a batch's deadline, or its creation time under FIFO),
each lane in the order its queries came. The front of the queue is the front of the lowest
key's lane; the back, the back of the highest key's. A moved query keeps its key, so it goes
ahead of later keys in the recipient's queue, as the real queue's ranks do; within its key it
goes to the back (the real queue keeps its submission place there). With one key (a run without
deadlines) this is one deque, as fast as before.
"""

from __future__ import annotations

import bisect
from collections import deque


class OrderedQueue:
    def __init__(self) -> None:
        self._lanes: dict[float, deque[int]] = {}
        self._keys: list[float] = []  # sorted keys of the lanes that hold queries
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def append(self, q: int, key: float = 0.0) -> None:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = deque()
            bisect.insort(self._keys, key)
        lane.append(q)
        self._n += 1

    def _take(self, i: int, front: bool) -> int:
        key = self._keys[i]
        lane = self._lanes[key]
        q = lane.popleft() if front else lane.pop()
        if not lane:
            del self._lanes[key]
            self._keys.pop(i)
        self._n -= 1
        return q

    def popleft(self) -> int:
        """The next query to run."""
        return self._take(0, True)

    def pop(self) -> int:
        """The query that would run last (movers take from here)."""
        return self._take(len(self._keys) - 1, False)

    def tail(self, n: int) -> list[int]:
        """The last ``n`` queries, front first."""
        out: list[int] = []
        for key in reversed(self._keys):
            lane = self._lanes[key]
            take = min(n - len(out), len(lane))
            out[:0] = [lane[i] for i in range(len(lane) - take, len(lane))]
            if len(out) >= n:
                break
        return out
