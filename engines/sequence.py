"""One query inside the engine: its tokens, how many have KV cached, its blocks and its sampling state."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

import torch

from engines.interface import Request, SamplingParams

BlockKey = bytes | int  # a full block's prefix-cache key


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def stable_seed(request_id: str) -> int:
    """A seed from the request id that is the same in every process (``hash()`` of a str is
    randomised per process), so a retried or moved query samples the same tokens."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") & (2**63 - 1)


@dataclass
class Sequence:
    """Request state: prompt + generated tokens; ``num_computed`` of them have their KV in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    predicted_tokens: int | None = None
    prompt: str = ""
    arrival_time: float = 0.0
    cache_salt: str = ""  # its tenant's: the parent key of its first block (engines.kv_cache.root_key)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # of num_computed, tokens taken from the prefix cache at admission
    num_keyed_blocks: int = 0  # leading blocks of block_table already keyed in the prefix cache
    # prefix-cache keys of its full blocks, once computed (engines.kv_cache's digests; the simulator
    # sets ints of its own, equal where the digests would be)
    block_keys: list[BlockKey] = field(default_factory=list)
    reserved_tokens: int = 0  # KV tokens set aside at admission (prompt + predicted * (1 + margin))
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str = ""
    num_preemptions: int = 0
    first_token_time: float = 0.0
    finish_time: float = 0.0
    generator: torch.Generator | None = None

    @classmethod
    def from_request(cls, req: Request, token_ids: list[int], resumed: list[int] | None = None) -> Sequence:
        """The sequence of ``req`` with the prompt's ``token_ids``; ``resumed``: the tokens of its partial output."""
        seq = cls(
            request_id=req.request_id,
            prompt_token_ids=list(token_ids),
            sampling=req.sampling,
            predicted_tokens=req.predicted_tokens,
            prompt=req.prompt,
            arrival_time=req.arrival_time,
            cache_salt=req.cache_salt,
        )
        if resumed:  # resumed: prefilled with the prompt, then decoded from here
            seq.output_token_ids = list(resumed)
        if req.sampling.temperature > 0:
            seq.generator = torch.Generator()
            seq.generator.manual_seed(
                req.sampling.seed if req.sampling.seed is not None else stable_seed(req.request_id)
            )
        return seq

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
