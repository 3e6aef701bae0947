"""Static batching with Hugging Face ``generate``: the baseline engine (MICO's "static batch").

Each ``step()`` takes up to ``max_batch`` waiting requests with the same sampling
settings, pads them on the left and runs ``model.generate`` until the longest one is
done; nobody joins or leaves mid-batch. It implements :class:`engines.interface.Engine`
so the worker can drive it like any other backend.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from engines.interface import EngineStats, Request, RequestOutput
from localmodels.prompt_ids import prompt_ids


def batch_forwards(rows: int, longest_prompt: int, new_tokens: int) -> tuple[tuple[int, int, int], ...]:
    """The forward passes of one ``generate`` call, as a GPU computes them: every prompt padded to the
    longest (the pass that samples the first token), then ``new_tokens - 1`` passes decoding every row,
    padded or finished, until the longest is done. ``(prefill tokens, decoded rows, repeats)`` each."""
    return ((rows * longest_prompt, 0, 1), (0, rows, max(0, new_tokens - 1)))


class StaticBatchEngine:
    def __init__(self, model, tokenizer, max_batch: int = 8, max_prompt_tokens: int = 1024):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_prompt_tokens = max_prompt_tokens
        self.waiting: deque[Request] = deque()
        self._aborted: set[str] = set()
        self._running = 0
        self._kv_used = 0
        self._kv_step = 0  # KV of the last batch while it ran: the whole batch's, until its longest ends
        self._forwards: tuple[tuple[int, int, int], ...] = ()  # the last batch's forward passes (stats)
        self._generated = 0
        self._window: deque[tuple[float, int]] = deque(maxlen=32)  # (seconds, tokens) of recent steps

    # ------------------------------------------------------------------ Engine protocol

    def add_request(self, request: Request) -> None:
        request.sampling.validate()
        if request.prompt_token_ids is None:
            ids = prompt_ids(self.tokenizer, request.prompt)
            request.prompt_token_ids = ids[-self.max_prompt_tokens :]
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def free_slots(self) -> int:
        return max(0, 2 * self.max_batch - len(self.waiting))

    def stats(self) -> EngineStats:
        secs = sum(s for s, _ in self._window)
        toks = sum(t for _, t in self._window)
        return EngineStats(
            running=self._running,
            waiting=len(self.waiting),
            kv_used_tokens=self._kv_used,
            kv_total_tokens=self.max_batch * (self.max_prompt_tokens + 1024),
            tokens_per_s=toks / secs if secs > 0 else 0.0,
            generated_tokens=self._generated,
            kv_step_tokens=self._kv_step,
            step_forwards=self._forwards,
        )

    def step(self) -> list[RequestOutput]:
        outputs = self._drop_aborted()
        batch = self._take_batch()
        if not batch:
            self._kv_step = 0
            self._forwards = ()
            return outputs
        self._running = len(batch)
        start = time.time()
        try:
            outputs.extend(self._generate(batch))
        finally:
            self._running = 0
            self._kv_used = 0
        elapsed = time.time() - start
        produced = sum(o.completion_tokens for o in outputs)
        self._generated += produced
        self._window.append((elapsed, produced))
        return outputs

    # ------------------------------------------------------------------ internals

    def _drop_aborted(self) -> list[RequestOutput]:
        if not self._aborted:
            return []
        kept, out = deque(), []
        for r in self.waiting:
            if r.request_id in self._aborted:
                out.append(RequestOutput(r.request_id, "", [], len(r.prompt_token_ids or []), "abort"))
            else:
                kept.append(r)
        self.waiting = kept
        self._aborted.clear()
        return out

    def _take_batch(self) -> list[Request]:
        if not self.waiting:
            return []
        head = self.waiting[0].sampling
        key = (head.temperature, head.top_p, head.forced_length is not None)
        batch, rest = [], deque()
        for r in self.waiting:
            s = r.sampling
            if len(batch) < self.max_batch and (s.temperature, s.top_p, s.forced_length is not None) == key:
                batch.append(r)
            else:
                rest.append(r)
        self.waiting = rest
        return batch

    @torch.inference_mode()
    def _generate(self, batch: list[Request]) -> list[RequestOutput]:
        pad = self.tokenizer.pad_token_id
        longest = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, r in enumerate(batch):
            ids = r.prompt_token_ids
            input_ids[i, longest - len(ids) :] = torch.tensor(ids)
            attention[i, longest - len(ids) :] = 1
        s = batch[0].sampling
        forced = s.forced_length is not None
        new_tokens = max(r.sampling.target_tokens for r in batch)
        self._kv_used = self._kv_step = len(batch) * (longest + new_tokens)
        self._forwards = batch_forwards(len(batch), longest, new_tokens)
        kwargs = dict(max_new_tokens=new_tokens, pad_token_id=pad)
        if forced:
            kwargs["min_new_tokens"] = new_tokens
        if s.temperature > 0:
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p)
            if s.seed is not None:
                torch.manual_seed(s.seed)
        else:
            kwargs.update(do_sample=False)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention, **kwargs)
        now = time.time()
        eos = self.tokenizer.eos_token_id
        results = []
        for i, r in enumerate(batch):
            gen = out[i, longest:].tolist()
            limit = r.sampling.target_tokens
            gen = gen[:limit]
            reason = "length"
            if not forced and eos in gen:
                gen = gen[: gen.index(eos)]
                reason = "stop"
            elif not forced and pad in gen:
                gen = gen[: gen.index(pad)]
                reason = "stop"
            text = self.tokenizer.decode(gen, skip_special_tokens=True)
            results.append(
                RequestOutput(
                    r.request_id,
                    text,
                    gen,
                    len(r.prompt_token_ids),
                    reason,
                    first_token_time=now,
                    finish_time=now,
                )
            )
        return results
