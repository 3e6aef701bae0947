"""The boundary between the Redis worker and any engine: typed requests, outputs and stats.

The worker feeds :class:`Request` objects into an engine with ``add_request`` and calls
``step()`` in a loop; each step returns the outputs of the queries that finished in it.
Every backend (the static-batch baseline, the native iteration-level engine, vLLM)
implements :class:`Engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from workqueue.partial import Partial


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    forced_length: int | None = None  # benchmarks: ignore EOS, stop after exactly this many tokens

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.forced_length is not None and self.forced_length < 1:
            raise ValueError(f"forced_length must be >= 1, got {self.forced_length}")

    @property
    def target_tokens(self) -> int:
        """Most tokens this request may generate."""
        return self.forced_length if self.forced_length is not None else self.max_tokens

    def stop_reason(
        self, generated: int, last: int, eos: int | None, total: int = 0, max_positions: int | None = None
    ) -> str:
        """Why a query that has ``generated`` tokens, ``last`` the latest, stops (``""``: it goes on), in this
        order: a forced length, the end-of-sequence token ``eos``, ``max_tokens``, then the model's length
        (``total`` tokens, prompt and output, reach ``max_positions``)."""
        if self.forced_length is not None:
            return "length" if generated >= self.forced_length else ""
        if eos is not None and last == eos:
            return "stop"
        if generated >= self.max_tokens:
            return "length"
        return "length" if max_positions and total >= max_positions else ""


@dataclass
class Request:
    request_id: str
    prompt: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: list[int] | None = None  # filled by the engine when None
    predicted_tokens: int | None = None  # predicted response length (for KV admission)
    arrival_time: float = 0.0
    # the OpenAI request it came from (workqueue.openai_body): a chat's messages, fields passed through
    openai_body: dict = field(default_factory=dict)
    # its tenant's salt: starts the hash chain of its prefix-cache keys, so tenants share no cached
    # prefix (vLLM's ``cache_salt``); "": the one shared cache
    cache_salt: str = ""
    # what an earlier run generated (its partial output, workqueue.partial): a :class:`Resumable` engine continues
    # it and generates only the rest of max_tokens; its output holds all of it, and counts every token once
    resume: Partial | None = None


@dataclass
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS), "length" (max_tokens / forced length), "abort", "error"
    first_token_time: float = 0.0
    finish_time: float = 0.0
    error: str = ""
    # completion tokens as a server counted them (the endpoint backend: it gets text and usage, no ids)
    counted_tokens: int | None = None
    # what a server answered beyond the text (workqueue.openai_body.EXTRA_ANSWERS): logprobs, tool_calls
    openai_extra: dict | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids) if self.counted_tokens is None else self.counted_tokens


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    tokens_per_s: float = 0.0  # measured generation throughput (recent window)
    generated_tokens: int = 0  # since start
    kv_step_tokens: int = 0  # KV tokens held while the last step ran (what the step paid for)
    # the last step's forward passes, (prefill tokens, decoded queries, repeats) each: what an emulated
    # device charges for it (engines.device); empty where the backend does not report them
    step_forwards: tuple[tuple[int, int, int], ...] = ()
    # a plan's stages emulating their devices by cost model (fleetbatch engine serve --device-cost plan), summed
    # over the stages: micro-batches charged, and those whose compute outlasted the model
    device_steps: int = 0
    device_overrun_steps: int = 0
    # the prefix cache (native engine): tokens of admitted queries that needed KV, and those of them
    # found cached (prefill saved), both since start; hit rate = hit / lookup
    prefix_lookup_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0

    @property
    def kv_free_tokens(self) -> int:
        return max(0, self.kv_total_tokens - self.kv_used_tokens)


class EngineFailure(RuntimeError):
    """The engine cannot go on (a pipeline stage died, no endpoint answers): ``step`` raises it, and the
    worker gives every query it holds back to the queue; the message says why."""


@runtime_checkable
class Engine(Protocol):
    def add_request(self, request: Request) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def free_slots(self) -> int:
        """How many more requests the worker should hand over now (0 = engine is full)."""
        ...


@runtime_checkable
class Resumable(Protocol):
    """An engine that resumes a query from its partial output (:attr:`Request.resume`) and can hand out what the
    queries it runs generated so far (the native engine, the vLLM and endpoint backends). The worker checkpoints them
    (engines.checkpoints)."""

    #: True: tokens are generated only inside ``step()`` (the native engine), so the worker may hold a step until
    #: the checkpoints are written (a hard kill then loses at most a checkpoint's tokens); False: they come in
    #: between steps (the endpoint backend's streams), and a checkpoint is as recent as the last tick's
    steps_generate: ClassVar[bool]

    def progress(self) -> dict[str, int]:
        """How many tokens each query the engine holds generated so far (a resumed one's partial output included)."""
        ...

    def partial(self, request_id: str) -> Partial | None:
        """What the query generated so far, as its partial output (None: not here, or nothing it could resume from)."""
        ...

    def suspend(self, request_id: str) -> Partial | None:
        """Take a query out without an output (it is checkpointed elsewhere): what it generated (empty: nothing it
        could resume from), or None: it is not here, finished, or in a micro-batch still in flight (ask again after
        the next step)."""
        ...
