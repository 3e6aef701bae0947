"""One step's (or one micro-batch's) layout: which tokens of which queries, at which cache slots.

The driver builds a :class:`StepBatch` from the scheduler's chunks; a pipeline stage in another
process rebuilds the same object from the flat ``int64`` tensor of :meth:`StepBatch.to_tensor`,
so every stage computes attention over the same positions, slots and block tables. A stage
needs no token ids (only the first stage embeds them) and no sequence objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.kv_cache import slot_ids
from engines.scheduler import ScheduledChunk


@dataclass(frozen=True)
class ChunkLayout:
    """``num_tokens`` tokens from position ``start`` of one query; ``samples``: a token is sampled after it."""

    start: int
    num_tokens: int
    samples: bool
    block_table: tuple[int, ...]

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start > 0


@dataclass
class AttentionMeta:
    """Index tensors for one step, shared by all layers."""

    decode_rows: torch.Tensor | None  # rows of the flat batch that are decode tokens
    decode_slots: torch.Tensor | None  # [B, L] cache slots of each decode query's context (padded)
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] True where the slot is real
    all_decode: bool
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (row0, n, slots [ctx], mask or None)


def block_slots(tables: list[tuple[int, ...]], length: int, block_size: int) -> torch.Tensor:
    """[B, length] cache slots from block tables (padded with block 0; masked by the caller)."""
    nb = -(-length // block_size)
    bt = torch.zeros(len(tables), nb, dtype=torch.long)
    for r, t in enumerate(tables):
        k = min(nb, len(t))
        bt[r, :k] = torch.tensor(t[:k], dtype=torch.long)
    slots = bt[:, :, None] * block_size + torch.arange(block_size)
    return slots.view(len(tables), -1)[:, :length]


class StepBatch:
    """Positions, cache slots, sampled rows and attention metadata of one step's flat token batch."""

    def __init__(self, chunks: list[ChunkLayout], block_size: int, token_ids: list[int] | None = None):
        self.chunks = chunks
        self.block_size = block_size
        self.token_ids = token_ids
        pos: list[int] = []
        slots: list[int] = []
        self.sample_rows: list[int] = []
        for c in chunks:
            end = c.start + c.num_tokens
            pos.extend(range(c.start, end))
            slots.extend(slot_ids(c.block_table, block_size, c.start, end))
            if c.samples:
                self.sample_rows.append(len(pos) - 1)
        self.positions = torch.tensor(pos)
        self.slots = torch.tensor(slots)
        self.meta = self._meta()

    @classmethod
    def from_chunks(cls, chunks: list[ScheduledChunk], block_size: int) -> StepBatch:
        layouts, ids = [], []
        for c in chunks:
            layouts.append(ChunkLayout(c.start, c.num_tokens, c.samples, tuple(c.seq.block_table)))
            ids.extend(c.seq.token_ids(c.start, c.start + c.num_tokens))
        return cls(layouts, block_size, ids)

    # ---- wire form: [block_size, n_chunks, (start, n, samples, len(table), *table) per chunk] ----------
    def to_tensor(self) -> torch.Tensor:
        flat = [self.block_size, len(self.chunks)]
        for c in self.chunks:
            flat += [c.start, c.num_tokens, int(c.samples), len(c.block_table), *c.block_table]
        return torch.tensor(flat, dtype=torch.long)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> StepBatch:
        v = t.tolist()
        block_size, n, at = v[0], v[1], 2
        chunks = []
        for _ in range(n):
            start, num, samples, k = v[at : at + 4]
            chunks.append(ChunkLayout(start, num, bool(samples), tuple(v[at + 4 : at + 4 + k])))
            at += 4 + k
        return cls(chunks, block_size)

    def to(self, device: torch.device) -> StepBatch:
        """Move the index tensors to ``device`` (in place; nothing to do on the CPU); returns ``self``."""
        if device.type == "cpu":
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        m = self.meta
        self.positions, self.slots = self.positions.to(device), self.slots.to(device)
        self.meta = AttentionMeta(
            move(m.decode_rows),
            move(m.decode_slots),
            move(m.decode_mask),
            m.all_decode,
            [(row, n, slots.to(device), move(mask)) for row, n, slots, mask in m.prefills],
        )
        return self

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def num_decode(self) -> int:
        return sum(c.is_decode for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return all(c.is_decode for c in self.chunks)

    def _meta(self) -> AttentionMeta:
        dec_rows, dec_tables, dec_ctx, prefills = [], [], [], []
        row = 0
        for c in self.chunks:
            ctx = c.start + c.num_tokens
            if c.is_decode:
                dec_rows.append(row)
                dec_tables.append(c.block_table)
                dec_ctx.append(ctx)
            else:
                slots = block_slots([c.block_table], ctx, self.block_size)[0]
                mask = None
                if c.start > 0:  # causal with an offset: query i sees keys 0..start+i
                    mask = torch.arange(ctx)[None, :] <= (c.start + torch.arange(c.num_tokens))[:, None]
                prefills.append((row, c.num_tokens, slots, mask))
            row += c.num_tokens
        if not dec_rows:
            return AttentionMeta(None, None, None, False, prefills)
        length = max(dec_ctx)
        ctx_t = torch.tensor(dec_ctx)
        mask = (torch.arange(length)[None, :] < ctx_t[:, None])[:, None, None, :]
        return AttentionMeta(
            torch.tensor(dec_rows),
            block_slots(dec_tables, length, self.block_size),
            mask,
            len(dec_rows) == row,
            prefills,
        )
