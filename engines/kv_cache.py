"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, and the prefix cache.

:class:`KVCacheManager` owns only the numbers (which block belongs to which sequence); the
tensors live in :class:`engines.model_runner.ModelRunner`, one pool per layer shaped
``[num_blocks * block_size, kv_heads, head_dim]``, addressed by slot = block * block_size + offset.

**The prefix cache** (``prefix_cache=True``; as vLLM's automatic prefix caching does it). Every
full block a query has computed is keyed by a hash chained over the tokens: the block's key is
a 128-bit BLAKE2 digest of its parent block's key and its own token ids, so a key names the
whole prefix up to the block's end (a collision-resistant digest, so one tenant's prompt cannot
be made to read another's KV). **Tenants apart**: the chain of a query with a ``cache_salt`` (its
tenant's, set by the gateway: :attr:`engines.interface.Request.cache_salt`) starts from a digest of
the salt (:func:`root_key`) instead of the empty key, so the same prompt of two tenants has two sets
of keys and one tenant never hits (nor times) another's cached prefix; queries without a salt share
one cache, as before. Blocks are reference-counted. When no query holds a keyed block
any more it is not freed but kept, least recently used first, and handed out again only when
the plain free list is empty (then its key is forgotten). A new query takes the longest run of
cached blocks that matches its tokens (:meth:`KVCacheManager.lookup`; at most its first
``num_tokens - 1`` tokens, so at least one token is computed and sampled from) and prefills
only the rest. Keyed blocks are never written again: a query computes only positions past its
cached run, into blocks of its own.

Pipeline stages keep their own layers' KV at the same block ids (the driver's block tables go
to every stage), so a hit is a hit in every stage; int8 KV caches the codes and their scales.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from hashlib import blake2b

from engines.sequence import BlockKey, Sequence

_ROOT = b""  # the parent key of a query's first block (a query without a salt)


def slot_ids(table, block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of token positions ``start..end-1`` of a query with block table ``table``."""
    return [table[j // block_size] * block_size + j % block_size for j in range(start, end)]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: a digest of its parent's key and its token ids (chained)."""
    return blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def root_key(cache_salt: str) -> bytes:
    """The parent key of the first block of a query with ``cache_salt``: the empty key without one, else
    a digest of the salt (as long as a block's key, kept apart from every block's by its own prefix)."""
    if not cache_salt:
        return _ROOT
    return blake2b(b"fleetbatch-cache-salt\0" + cache_salt.encode(), digest_size=16).digest()


def block_keys(seq: Sequence, block_size: int, num_blocks: int) -> list[BlockKey]:
    """The keys of ``seq``'s first ``num_blocks`` full blocks (computed once, kept on the sequence:
    a block's tokens never change, so neither does its key)."""
    keys = seq.block_keys
    if len(keys) < num_blocks:
        tokens = seq.token_ids(len(keys) * block_size, num_blocks * block_size)
        parent = keys[-1] if keys else root_key(seq.cache_salt)
        for j in range(num_blocks - len(keys)):
            parent = block_key(parent, tokens[j * block_size : (j + 1) * block_size])
            keys.append(parent)
    return keys[:num_blocks]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._free: deque[int] = deque(range(num_blocks))  # blocks holding nothing worth keeping
        self._refs = [0] * num_blocks  # queries holding each block
        self._cached: OrderedDict[int, None] = OrderedDict()  # unheld keyed blocks, least recently used first
        self._block_of: dict[BlockKey, int] = {}  # key -> block
        self._key_of: dict[int, BlockKey] = {}  # block -> key
        # tokens of admitted queries that needed KV, and those found cached: prefill saved (cumulative;
        # a preempted query's readmission counts again, its hits being recomputation saved)
        self.lookup_tokens = 0
        self.hit_tokens = 0

    @property
    def total_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks a query can take: the free list and the unheld cached blocks."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        """Blocks held by queries."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a key (held or not): the prefix cache's contents."""
        return len(self._key_of)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    # ---- taking and giving back blocks -----------------------------------------------------
    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently used unheld cached block
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
        self._refs[block] = 1
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens; False (nothing taken) if blocks run short."""
        need = blocks_for(num_tokens, self.block_size) - len(seq.block_table)  # extra blocks
        if need <= 0:  # the common case: a decode step needs a new block once every block_size tokens
            return True
        if need > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def free(self, seq: Sequence) -> int:
        """Give back all of ``seq``'s blocks at once; returns how many it held. A keyed block no one
        holds any more stays cached (its last blocks first in line for eviction)."""
        n = len(seq.block_table)
        kept = []
        for block in seq.block_table:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    kept.append(block)
                else:
                    self._free.append(block)
        for block in reversed(kept):  # a prefix's last blocks are the first to go
            self._cached[block] = None
        seq.block_table = []
        seq.num_computed = 0
        seq.num_keyed_blocks = 0
        seq.num_cached_tokens = 0
        return n

    # ---- the prefix cache --------------------------------------------------------------------
    def lookup(self, seq: Sequence) -> list[int]:
        """The blocks of the longest cached run of ``seq``'s full blocks (its last token excluded);
        nothing changes. Empty when the cache is off or ``seq`` already holds blocks."""
        if not self.prefix_cache or seq.block_table:
            return []
        full = (seq.num_tokens - 1) // self.block_size
        if full <= 0 or not self._block_of:
            return []
        hit = []
        for key in block_keys(seq, self.block_size, full):
            block = self._block_of.get(key)
            if block is None:
                break
            hit.append(block)
        return hit

    def admit(self, seq: Sequence, hit: list[int], num_tokens: int) -> bool:
        """Give a waiting ``seq`` the cached blocks ``hit`` (from :meth:`lookup`) and blocks for its
        first ``num_tokens`` tokens; False (nothing taken) if blocks run short. ``seq``'s computed
        tokens start after its cached run."""
        unheld = sum(1 for b in hit if self._refs[b] == 0)  # these leave the takeable pool
        need = blocks_for(num_tokens, self.block_size) - len(hit)
        if need > self.num_free_blocks - unheld:
            return False
        for block in hit:
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
        seq.block_table = list(hit)
        seq.num_computed = seq.num_cached_tokens = len(hit) * self.block_size
        seq.num_keyed_blocks = len(hit)
        self.lookup_tokens += seq.num_tokens
        self.hit_tokens += seq.num_cached_tokens
        return self.allocate(seq, num_tokens)

    def commit(self, seq: Sequence) -> None:
        """Key ``seq``'s newly computed full blocks, so that later queries can take them (a block
        whose key another block already has stays ``seq``'s own and is freed when it finishes)."""
        if not self.prefix_cache:
            return
        full = seq.num_computed // self.block_size
        if full <= seq.num_keyed_blocks:
            return
        keys = block_keys(seq, self.block_size, full)
        for j in range(seq.num_keyed_blocks, full):
            block = seq.block_table[j]
            if keys[j] not in self._block_of and block not in self._key_of:
                self._block_of[keys[j]] = block
                self._key_of[block] = keys[j]
        seq.num_keyed_blocks = full

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of token positions ``start..end-1`` of ``seq``."""
        return slot_ids(seq.block_table, self.block_size, start, end)
