"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, freeing at once.

:class:`KVCacheManager` owns only the numbers (which block belongs to which sequence); the
tensors live in :class:`engines.model_runner.ModelRunner`, one pool per layer shaped
``[num_blocks * block_size, kv_heads, head_dim]``, addressed by slot = block * block_size + offset.
"""

from __future__ import annotations

from collections import deque

from engines.sequence import Sequence


def slot_ids(table, block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of token positions ``start..end-1`` of a query with block table ``table``."""
    return [table[j // block_size] * block_size + j % block_size for j in range(start, end)]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def total_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens; False (nothing taken) if blocks run short."""
        need = blocks_for(num_tokens, self.block_size) - len(seq.block_table)  # extra blocks
        if need <= 0:  # the common case: a decode step needs a new block once every block_size tokens
            return True
        free = self._free
        if need > len(free):
            return False
        seq.block_table.extend(free.popleft() for _ in range(need))
        return True

    def free(self, seq: Sequence) -> int:
        """Return all of ``seq``'s blocks at once; returns how many were freed."""
        n = len(seq.block_table)
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        return n

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of token positions ``start..end-1`` of ``seq``."""
        return slot_ids(seq.block_table, self.block_size, start, end)
