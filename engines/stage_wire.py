"""Messages between pipeline stages: one packed byte buffer per hop, received into pre-posted buffers.

A message is ``header | layout | counters | payload`` in one ``uint8`` tensor: the header is
int64 ``[kind, layout_len, rows, cols, flags]``, the layout the micro-batch's
:class:`~engines.step_batch.StepBatch` (int64), the counters a float64 ``[stages, n]`` trailer
that every stage fills in with its own row, and the payload the hidden states
``[rows, hidden]`` (or, back to the driver, the logits ``[sampled, vocab]``). ``GREEDY`` in the
flags marks a micro-batch whose sampled queries all decode greedily: the last stage picks
their tokens itself and sends back token ids (in the layout field) instead of logits.

One message per hop, and a receive always posted ahead into a buffer of the largest possible
size (gloo fills a larger buffer with a shorter message): a sender never waits for the
receiver to ask, so a busy stage does not hold up the one before it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

STEP, STOP = 1, 2
GREEDY = 1  # flag: every sampled query of the micro-batch is greedy (the last stage samples)
HEADER = 5  # int64 fields


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def pack(
    kind: int,
    layout: torch.Tensor,
    counters: torch.Tensor,
    payload: torch.Tensor | None,
    flags: int = 0,
) -> torch.Tensor:
    if payload is not None and payload.dim() != 2:
        raise ValueError(f"a message's payload is [rows, cols], got shape {tuple(payload.shape)}")
    rows, cols = (0, 0) if payload is None else payload.shape
    header = torch.tensor([kind, layout.numel(), rows, cols, flags], dtype=torch.long)
    parts = [_bytes(header), _bytes(layout), _bytes(counters)]
    if payload is not None and payload.numel():
        parts.append(_bytes(payload.detach().cpu() if payload.device.type != "cpu" else payload))
    return torch.cat(parts)


@dataclass
class Message:
    kind: int
    layout: torch.Tensor
    counters: torch.Tensor
    payload: torch.Tensor  # [rows, cols]; views into the receive buffer until it is released
    flags: int = 0


def unpack(buf: torch.Tensor, num_stages: int, num_counters: int, dtype: torch.dtype) -> Message:
    kind, layout_len, rows, cols, flags = buf[: HEADER * 8].view(torch.long).tolist()
    at = HEADER * 8
    layout = buf[at : at + 8 * layout_len].view(torch.long)
    at += 8 * layout_len
    n = num_stages * num_counters * 8
    counters = buf[at : at + n].view(torch.float64).view(num_stages, num_counters)
    at += n
    size = rows * cols * torch.empty((), dtype=dtype).element_size()
    payload = buf[at : at + size].view(dtype).view(rows, cols)
    return Message(kind, layout, counters, payload, flags)


def capacity(
    layout_len: int, num_stages: int, num_counters: int, rows: int, cols: int, dtype: torch.dtype
) -> int:
    """Bytes of the largest message: ``rows`` payload rows and a layout of ``layout_len`` int64s."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 8 * (HEADER + layout_len + num_stages * num_counters) + rows * cols * elem


class Inbox:
    """Receives from one peer into ``depth`` buffers posted ahead; ``get`` the next, ``release`` it when done."""

    def __init__(self, src: int, nbytes: int, depth: int = 2) -> None:
        self.src = src
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(depth)]
        self.posted: deque = deque()
        self._next = 0
        for _ in range(depth):
            self._post()

    def _post(self) -> None:
        buf = self.bufs[self._next % len(self.bufs)]
        self.posted.append((dist.irecv(buf, self.src), buf))
        self._next += 1

    def get(self) -> torch.Tensor:
        work, buf = self.posted.popleft()
        work.wait()
        return buf

    def release(self) -> None:
        """The last buffer from ``get`` is free: post the next receive into it."""
        self._post()


class Outbox:
    """Sends without waiting; keeps each buffer alive until its send is done."""

    def __init__(self, dst: int) -> None:
        self.dst = dst
        self.pending: list = []

    def send(self, buf: torch.Tensor) -> None:
        self.pending = [(w, b) for w, b in self.pending if not w.is_completed()]
        self.pending.append((dist.isend(buf, self.dst), buf))

    def flush(self) -> None:
        for w, _ in self.pending:
            w.wait()
        self.pending = []
