"""The vLLM backend's engine (GPU only): :class:`VLLMEngine`, :class:`engines.interface.Engine` over ``vllm.LLMEngine``,
driven step by step (iteration-level batching is vLLM's own); its arguments come from :mod:`engines.vllm_backend`.

**Resuming** (:class:`engines.interface.Resumable`). vLLM generates only inside ``LLMEngine.step()``, whose outputs
carry each query's tokens and text so far, so the worker checkpoints them between steps as it does the native
engine's. A query claimed with a partial output is sent as token ids, its prompt's (as vLLM tokenizes a text
prompt: the served model's tokenizer with its special tokens) followed by the partial output's: its ids where it
has them, else its text's tokens (:func:`engines.partials.resumed_ids`, the native engine's rule). vLLM then
generates only what is left of ``max_tokens`` (and of a forced length); the result is the whole answer (the partial
text, then vLLM's text of the new tokens, which it detokenizes after the partial tokens), its ``prompt_tokens``
the prompt's alone, its completion tokens every token once. From ids (a native or vLLM cluster of the same model)
greedy decoding continues token for token as the uninterrupted run, and the answer's text is all its ids decoded
(a partial text cut inside a character is not kept as it was cut); from text (an endpoint cluster's partial output)
the tokenization at the seam may differ by a token or two, and the answer is the partial text followed by vLLM's.
A partial output that already ended (the end-of-sequence token last, or ``max_tokens`` reached) is answered at
once, as the native engine does. Without the served model's tokenizer nothing is resumed: the query runs from the
start.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.interface import EngineStats, Request, RequestOutput
from engines.partials import resumed_ids, text_of
from engines.vllm_backend import engine_kwargs
from workqueue.partial import Partial

log = logging.getLogger(__name__)

#: the queries the engine claims at once when vLLM picks max_num_seqs itself (its default for offline use)
VLLM_DEFAULT_RUNNING = 256
#: the first vLLM whose prompts take ``cache_salt`` (a tenant's salt of its prefix-cache keys)
CACHE_SALT_SINCE = (0, 9)


def sampling_kwargs(request: Request, done: int = 0) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keyword arguments for a request (forced length = ignore EOS, exact count) that
    generated ``done`` tokens already (its partial output): only the rest is asked for."""
    s = request.sampling
    kw: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_tokens": s.target_tokens - done,
        "seed": s.seed,
    }
    if s.forced_length is not None:
        kw.update(ignore_eos=True, min_tokens=s.forced_length - done)
    return kw


def takes_cache_salt(version: str) -> bool:
    """Whether a vLLM of ``version`` (``vllm.__version__``) takes ``cache_salt`` in a prompt."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= CACHE_SALT_SINCE


def vllm_prompt(
    request: Request, salts: bool = True, token_ids: list[int] | None = None
) -> str | dict[str, Any]:
    """What ``LLMEngine.add_request`` gets as the prompt: the text, or ``token_ids`` in its place
    (``{"prompt_token_ids": ...}``: a resumed query), with the request's tenant salt where the vLLM takes one
    (``salts``; ``{"prompt": text, "cache_salt": salt}``), so tenants share no cached prefix in vLLM's cache
    either."""
    salt = request.cache_salt if salts else ""
    if token_ids is not None:
        return {"prompt_token_ids": token_ids, **({"cache_salt": salt} if salt else {})}
    return {"prompt": request.prompt, "cache_salt": salt} if salt else request.prompt


def served_tokenizer(llm, path: str):
    """The tokenizer vLLM serves with (``LLMEngine.get_tokenizer()``), or where this vLLM has no such method the
    model directory's, as vLLM loads it."""
    get = getattr(llm, "get_tokenizer", None)
    if callable(get):
        return get()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True)
class _Resumed:
    """The partial output a request continues: the ids sent to vLLM after its prompt, its text, and whether those
    ids are the generated ones (the answer's text is then all its ids decoded) or its text's tokens (the text is
    then kept, and vLLM's follows it)."""

    ids: tuple[int, ...]
    text: str
    generated_ids: bool


@dataclass
class _SoFar:
    """A running request's output in vLLM: vLLM's own token list (which it appends to in place, step after
    step), how long it was at the last step, and the text then."""

    ids: list[int]
    count: int
    text: str


class VLLMEngine:
    """:class:`engines.interface.Engine` and :class:`engines.interface.Resumable` over ``vllm.LLMEngine`` (the
    module's docstring). ``tokenizer``: the served model's (a resumed query's prompt and partial text are
    tokenized with it; without one nothing is resumed); ``sampling``: what makes vLLM's ``SamplingParams``
    (``vllm.SamplingParams`` unless given)."""

    #: vLLM generates inside step() only: the worker may hold a step until the checkpoints are written
    steps_generate = True

    def __init__(
        self,
        llm_engine,
        max_running: int = VLLM_DEFAULT_RUNNING,
        salts: bool = True,
        tokenizer=None,
        sampling: Callable[..., Any] | None = None,
        max_model_len: int | None = None,
    ):
        self.llm = llm_engine
        self.max_model_len = max_model_len  # vLLM's, for a resumed query that already fills it
        self.max_running = max_running
        self.salts = salts  # the vLLM takes a request's cache_salt (vllm_prompt)
        self.tokenizer = tokenizer
        self._sampling = sampling
        self._unfinished: set[str] = set()
        self._first_token: dict[str, float] = {}
        self._so_far: dict[str, _SoFar] = {}  # this run's output, by request
        self._resumed: dict[str, _Resumed] = {}  # the partial output a request continues
        self._done: list[RequestOutput] = []  # answered without a step (aborted, or resumed already ended)
        self._generated = 0
        self._window: deque[tuple[float, int]] = deque(maxlen=32)  # (seconds, tokens) of the last steps

    @classmethod
    def from_args(cls, args) -> VLLMEngine:
        kwargs = engine_kwargs(args)  # checked first: a bad --vllm-arg never imports vLLM
        import vllm
        from vllm import EngineArgs, LLMEngine

        llm = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        scheduler = getattr(getattr(llm, "vllm_config", None), "scheduler_config", None)
        running = kwargs.get("max_num_seqs") or getattr(scheduler, "max_num_seqs", None)
        version = getattr(vllm, "__version__", "0")
        salts = takes_cache_salt(version)
        if not salts:
            log.warning("vLLM %s takes no cache_salt: its prefix cache is shared by every tenant", version)
        tokenizer = served_tokenizer(llm, kwargs.get("tokenizer") or kwargs["model"])
        model_config = getattr(getattr(llm, "vllm_config", None), "model_config", None)
        return cls(
            llm,
            max_running=running or VLLM_DEFAULT_RUNNING,
            salts=salts,
            tokenizer=tokenizer,
            max_model_len=getattr(model_config, "max_model_len", None),
        )

    def _params(self, **kw):
        if self._sampling is None:
            from vllm import SamplingParams

            self._sampling = SamplingParams
        return self._sampling(**kw)

    def add_request(self, request: Request) -> None:
        request.sampling.validate()
        rid = request.request_id
        resume = request.resume if self.tokenizer is not None else None
        resumed = resumed_ids(self.tokenizer, resume) or []
        if resume is None or not resumed:
            prompt = vllm_prompt(request, self.salts)
            self.llm.add_request(rid, prompt, self._params(**sampling_kwargs(request)))
            self._unfinished.add(rid)
            return
        prompt_ids = list(self.tokenizer.encode(request.prompt))
        generated = bool(resume.token_ids)
        base = _Resumed(
            tuple(resumed), text_of(self.tokenizer, resumed) if generated else resume.text, generated
        )
        ended = self._ended(request, resumed, len(prompt_ids))
        if ended:  # nothing is left to generate: the partial output is the answer
            now = time.time()
            self._done.append(RequestOutput(rid, base.text, resumed, len(prompt_ids), ended, now, now))
            return
        prompt = vllm_prompt(request, self.salts, prompt_ids + resumed)
        self.llm.add_request(rid, prompt, self._params(**sampling_kwargs(request, len(resumed))))
        self._resumed[rid] = base
        self._unfinished.add(rid)

    def _ended(self, request: Request, resumed: list[int], prompt_tokens: int) -> str:
        """Why a query that resumes ``resumed`` has nothing left to generate ("": it has), by the native engine's
        rule (``SamplingParams.stop_reason``; the model's length: vLLM's ``max_model_len``)."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        total = prompt_tokens + len(resumed)
        return request.sampling.stop_reason(len(resumed), resumed[-1], eos, total, self.max_model_len)

    def _joined(self, rid: str, ids: list[int], text: str) -> Partial:
        """The request's whole output: its partial output's, then this run's ``ids`` and ``text`` (which text: the
        module's docstring)."""
        base = self._resumed.get(rid)
        if base is None:
            return Partial(tuple(ids), text)
        every = base.ids + tuple(ids)
        return Partial(every, text_of(self.tokenizer, every) if base.generated_ids else base.text + text)

    def _count(self, rid: str) -> int:
        so_far = self._so_far.get(rid)
        return 0 if so_far is None else so_far.count

    def _forget(self, rid: str) -> None:
        self._unfinished.discard(rid)
        self._so_far.pop(rid, None)
        self._resumed.pop(rid, None)
        self._first_token.pop(rid, None)

    def abort_request(self, request_id: str) -> None:
        self.llm.abort_request([request_id])  # vLLM 0.11 takes a list
        if request_id in self._unfinished:
            self._forget(request_id)
            self._done.append(RequestOutput(request_id, "", [], 0, "abort", finish_time=time.time()))

    # ---- engines.interface.Resumable ------------------------------------------------------------
    def progress(self) -> dict[str, int]:
        """How many tokens each query the engine holds generated so far (a resumed one's partial output included)."""
        resumed = self._resumed
        return {
            rid: len(resumed[rid].ids if rid in resumed else ()) + self._count(rid)
            for rid in self._unfinished
        }

    def partial(self, request_id: str) -> Partial | None:
        """A query's tokens so far and their text, its partial output's first (None: not here)."""
        if request_id not in self._unfinished:
            return None
        so_far = self._so_far.get(request_id)
        if so_far is None:
            return self._joined(request_id, [], "")
        return self._joined(request_id, so_far.ids[: so_far.count], so_far.text)

    def suspend(self, request_id: str) -> Partial | None:
        """Abort a query in vLLM without an output; what it generated (None: not here, or finished)."""
        generated = self.partial(request_id)
        if generated is not None:
            self.llm.abort_request([request_id])
            self._forget(request_id)
        return generated

    # ---- the Engine protocol ----------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._unfinished) or bool(self._done)

    def free_slots(self) -> int:
        return max(0, self.max_running - len(self._unfinished))

    def stats(self) -> EngineStats:
        secs = sum(s for s, _ in self._window)
        toks = sum(t for _, t in self._window)
        return EngineStats(
            running=len(self._unfinished),
            tokens_per_s=toks / secs if secs > 0 else 0.0,
            generated_tokens=self._generated,
        )

    def step(self) -> list[RequestOutput]:
        out, self._done = self._done, []
        t0 = time.time()
        produced = 0
        for o in self.llm.step():
            rid, comp = o.request_id, o.outputs[0]
            if rid not in self._unfinished:  # aborted or suspended before vLLM saw it
                continue
            self._first_token.setdefault(rid, time.time())
            n = len(
                comp.token_ids
            )  # cumulative (vLLM's default output kind): the same list, longer each step
            produced += n - self._count(rid)
            self._so_far[rid] = _SoFar(comp.token_ids, n, comp.text)
            if o.finished:
                out.append(self._finished(o, comp))
        self._generated += produced
        self._window.append((time.time() - t0, produced))
        return out

    def _finished(self, o, comp) -> RequestOutput:
        rid = o.request_id
        whole = self._joined(rid, list(comp.token_ids), comp.text)
        resumed = len(whole.token_ids) - len(comp.token_ids)
        first = self._first_token.get(rid, time.time())
        self._forget(rid)
        return RequestOutput(
            rid,
            whole.text,
            list(whole.token_ids),
            len(o.prompt_token_ids or []) - resumed,  # the prompt's alone
            "stop" if comp.finish_reason == "stop" else "length",
            first_token_time=first,
            finish_time=time.time(),
        )
