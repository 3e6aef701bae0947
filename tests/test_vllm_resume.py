"""Issue 49, item 4, for the vLLM backend: a query checkpointed from vLLM's step outputs and resumed from its
partial output (:mod:`engines.vllm_engine`).

vLLM needs a GPU and is not installed here, so :class:`StandInLLM` stands in for ``vllm.LLMEngine``: the
calls :class:`~engines.vllm_engine.VLLMEngine` makes of it (``add_request`` with a text or token-id prompt,
``step`` returning each running request's tokens and text so far, ``abort_request``, ``get_tokenizer``), run
by the real random nano model with greedy decoding, one token a request a step, its text detokenized after
the prompt as vLLM's is. Everything else is real: the worker, its queue agent and a real Redis, and the native
engine on the same model for the runs across backends. ``scripts/gpu-check.sh`` runs the real vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from engines.interface import Request, Resumable, SamplingParams
from engines.vllm_engine import VLLMEngine
from engines.worker import Worker, WorkerConfig
from gateway.offload.offloader import Offloader
from localmodels import load_or_build
from tests.test_preemption import PROMPTS, claim_and_start, make_worker, partial, query, results
from workqueue import WorkQueue, connect, keys
from workqueue.invariants import check
from workqueue.partial import Partial


@dataclass
class _Running:
    prompt: list[int]
    params: dict
    out: list[int] = field(default_factory=list)


class StandInLLM:
    """What :class:`VLLMEngine` uses of ``vllm.LLMEngine``, run by a real model (the module's docstring)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.running: dict[str, _Running] = {}
        self.added: list[tuple[str, object, dict]] = []  # (request id, prompt, sampling) as given

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(self, request_id: str, prompt, params: dict) -> None:
        self.added.append((request_id, prompt, params))
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        else:
            ids = self.tokenizer.encode(prompt["prompt"])
        self.running[request_id] = _Running(ids, params)

    def abort_request(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self.running.pop(r, None)

    def _text(self, r: _Running) -> str:
        """The generated tokens' text, detokenized after the prompt (as vLLM's incremental detokenizer does)."""
        head = self.tokenizer.decode(r.prompt, skip_special_tokens=True)
        whole = self.tokenizer.decode(r.prompt + r.out, skip_special_tokens=True)
        return (
            whole[len(head) :]
            if whole.startswith(head)
            else self.tokenizer.decode(r.out, skip_special_tokens=True)
        )

    def step(self) -> list:
        outputs = []
        for rid, r in list(self.running.items()):
            with torch.no_grad():
                token = int(self.model(torch.tensor([r.prompt + r.out])).logits[0, -1].argmax())
            r.out.append(token)
            p, n = r.params, len(r.out)
            stop = (
                token == self.tokenizer.eos_token_id
                and not p.get("ignore_eos")
                and n >= p.get("min_tokens", 0)
            )
            finished = stop or n >= p["max_tokens"]
            comp = SimpleNamespace(
                token_ids=r.out,  # vLLM's own list, appended to in place step after step
                text=self._text(r),
                finish_reason=("stop" if stop else "length") if finished else None,
            )
            outputs.append(
                SimpleNamespace(request_id=rid, prompt_token_ids=r.prompt, finished=finished, outputs=[comp])
            )
            if finished:
                del self.running[rid]
        return outputs


@pytest.fixture(scope="module")
def parts():
    return load_or_build(None, arch="llama", size="nano")  # the model and tokenizer of tests.test_preemption


def vllm(parts) -> VLLMEngine:
    model, tok = parts
    return VLLMEngine(StandInLLM(model, tok), max_running=8, tokenizer=tok, sampling=dict)


def run(engine: VLLMEngine, requests: list[Request]):
    for r in requests:
        engine.add_request(r)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o
    return done


def summary(o) -> tuple:
    return o.token_ids, o.text, o.prompt_tokens, o.finish_reason, o.completion_tokens


def test_the_vllm_engine_is_resumable_and_generates_only_in_its_steps(parts):
    e = vllm(parts)
    assert isinstance(e, Resumable) and e.steps_generate
    assert (e.progress(), e.partial("x"), e.suspend("x")) == ({}, None, None)


def test_suspended_twice_and_resumed_it_equals_the_uninterrupted_run(parts):
    sp = SamplingParams(max_tokens=30)
    [whole] = run(vllm(parts), [Request("q", PROMPTS[1], sp)]).values()
    assert whole.completion_tokens == 30 or whole.finish_reason == "stop"
    resume, cuts = None, []
    for steps in (7, 9):  # preempted twice: each run continues the last one's partial output
        e = vllm(parts)
        e.add_request(Request("q", PROMPTS[1], sp, resume=resume))
        assert e.progress() == {"q": len(resume or ())}  # counted at once (the worker's resumed tokens)
        for _ in range(steps):
            e.step()
        got = e.partial("q")
        assert e.progress() == {"q": len(got)} and len(got) == len(resume or ()) + steps
        assert e.suspend("q") == got and not e.has_unfinished() and not e.llm.running  # aborted in vLLM too
        assert e.progress() == {} and e.suspend("q") is None
        resume = Partial.decode(got.encode())  # as Redis holds it
        cuts.append(len(resume))
        assert list(resume.token_ids) == whole.token_ids[: len(resume)]
        assert whole.text.startswith(resume.text) and resume.text
    assert cuts == [7, 16]
    e = vllm(parts)
    [last] = run(e, [Request("q", PROMPTS[1], sp, resume=resume)]).values()
    [(_, prompt, params)] = e.llm.added
    prompt_ids = parts[1].encode(PROMPTS[1])
    assert prompt == {"prompt_token_ids": prompt_ids + list(resume.token_ids)}  # the prompt, then the partial
    assert params["max_tokens"] == 30 - 16  # only the rest
    assert summary(last) == summary(whole)  # the whole answer, each token counted once, the real finish
    assert last.prompt_tokens == len(prompt_ids)
    assert e.stats().generated_tokens == 30 - 16  # this run's tokens: vLLM's list grows in place


def test_a_native_partial_output_continues_on_vllm_as_the_native_run_would(parts):
    from tests.test_preemption import engine

    native = engine()
    sp = SamplingParams(max_tokens=28)
    [whole] = native.generate([Request("n", PROMPTS[2], sp)])
    native.add_request(Request("n2", PROMPTS[2], sp))
    for _ in range(11):
        native.step()
    cut = native.suspend("n2")
    assert cut.text and 0 < len(cut) < 28
    [out] = run(vllm(parts), [Request("n2", PROMPTS[2], sp, resume=cut)]).values()
    assert summary(out) == summary(whole)


def test_a_partial_output_of_text_only_resumes_from_its_tokens(parts):
    tok = parts[1]
    sp = SamplingParams(max_tokens=24)
    [whole] = run(vllm(parts), [Request("t", PROMPTS[3], sp)]).values()
    ids = whole.token_ids[:10]
    text = tok.decode(ids, skip_special_tokens=True)
    e = vllm(parts)
    [out] = run(e, [Request("t", PROMPTS[3], sp, resume=Partial((), text, 10))]).values()  # an endpoint's
    seam = tok.encode(text, add_special_tokens=False)
    [(_, prompt, params)] = e.llm.added
    assert prompt["prompt_token_ids"] == tok.encode(PROMPTS[3]) + seam and params["max_tokens"] == 24 - len(
        seam
    )
    assert out.text.startswith(text) and out.completion_tokens == 24 or out.finish_reason == "stop"
    if seam == ids:  # the text tokenizes back to the generated tokens: the seam is exact
        assert summary(out) == summary(whole)


def test_a_partial_output_that_already_ended_is_answered_without_vllm(parts):
    """Ended as the native engine's scheduler says: the end-of-sequence token first, then max_tokens."""
    tok = parts[1]
    e = vllm(parts)
    ids = tuple(range(5, 17))
    full = Partial(ids, tok.decode(ids, skip_special_tokens=True))
    eos = Partial((5, 6, tok.eos_token_id), "two and the end")
    eos_at_max = Partial((*ids[:11], tok.eos_token_id), "")
    for name, p in (("len", full), ("eos", eos), ("eos_at_max", eos_at_max)):
        e.add_request(Request(name, PROMPTS[0], SamplingParams(max_tokens=12), resume=p))
    assert e.llm.added == [] and e.has_unfinished()
    done = {o.request_id: o for o in e.step()}
    assert (done["len"].finish_reason, done["len"].text, done["len"].completion_tokens) == (
        "length",
        full.text,
        12,
    )
    assert (done["eos"].finish_reason, done["eos"].completion_tokens) == ("stop", 3)
    assert done["eos_at_max"].finish_reason == "stop"  # as Scheduler.stop_reason orders them
    assert done["len"].prompt_tokens == len(tok.encode(PROMPTS[0])) and not e.has_unfinished()


def test_a_partial_output_that_fills_the_models_length_ends_there(parts):
    """As the uninterrupted run would have (and the native engine does): not a row failed by vLLM's prompt check."""
    model, tok = parts
    n = len(tok.encode(PROMPTS[0]))
    e = VLLMEngine(StandInLLM(model, tok), tokenizer=tok, sampling=dict, max_model_len=n + 5)
    ids = (7, 8, 9, 10, 11)
    e.add_request(
        Request("m", PROMPTS[0], SamplingParams(max_tokens=50), resume=Partial(ids, tok.decode(ids)))
    )
    [out] = e.step()
    assert (out.finish_reason, out.completion_tokens, out.prompt_tokens) == (
        "length",
        5,
        n,
    ) and not e.llm.added


def test_a_forced_length_and_the_tenant_salt_carry_over_to_the_rest(parts):
    tok = parts[1]
    e = vllm(parts)
    resume = Partial((7, 8, 9), tok.decode([7, 8, 9], skip_special_tokens=True))
    forced = SamplingParams(max_tokens=20, forced_length=10)
    e.add_request(Request("f", PROMPTS[0], forced, cache_salt="5a1f", resume=resume))
    [(_, prompt, params)] = e.llm.added
    assert prompt["cache_salt"] == "5a1f" and prompt["prompt_token_ids"][-3:] == [7, 8, 9]
    assert (params["max_tokens"], params["min_tokens"], params["ignore_eos"]) == (7, 7, True)
    out = run(e, [])["f"]
    assert out.completion_tokens == 10 and out.token_ids[:3] == [7, 8, 9]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)  # from ids: all of them decoded
    e.salts = False  # a vLLM that takes no salt
    e.add_request(Request("g", PROMPTS[0], SamplingParams(max_tokens=20), cache_salt="5a1f", resume=resume))
    assert "cache_salt" not in e.llm.added[-1][1]
    e.abort_request("g")
    [aborted] = e.step()
    assert (aborted.request_id, aborted.finish_reason) == ("g", "abort") and e.progress() == {}


def test_without_the_tokenizer_a_query_runs_from_the_start(parts):
    model, tok = parts
    e = VLLMEngine(StandInLLM(model, tok), tokenizer=None, sampling=dict)
    e.add_request(Request("n", PROMPTS[0], SamplingParams(max_tokens=8), resume=Partial((7, 8, 9), "x")))
    [(_, prompt, params)] = e.llm.added
    assert prompt == PROMPTS[0] and params["max_tokens"] == 8 and e.progress() == {"n": 0}


def test_a_notice_checkpoints_vllm_queries_and_a_native_cluster_finishes_them(redis_url, parts):
    """Through a real Redis: a vLLM cluster's worker preempted mid-run writes each running query's tokens and text
    as its partial output and gives it back, no attempt used; the offloader moves them; a native cluster resumes
    each and answers it as an uninterrupted run."""
    from tests.test_preemption import engine

    queue = WorkQueue(connect(redis_url))
    qs = [query(i, 32) for i in range(3)]
    queue.register_cluster("b", capacity_hint_tps=100.0)
    assert queue.create_batch("b1", [(q, "a") for q in qs])
    config = WorkerConfig(cluster="a", backend="vllm", record_observed=False, cancel_check_s=0.0)
    worker = Worker(queue, vllm(parts), config)
    assert worker.resumable and worker.checkpoints.every == 64
    claim_and_start(worker)
    for _ in range(10):
        worker.step()
    generated = {g: worker.engine.partial(g) for g in worker.engine.progress()}
    assert sorted(generated) == sorted(q.gid for q in qs) and all(len(p) == 10 for p in generated.values())
    assert queue.give_notice("a", 0) <= 0
    assert worker.agent.tick() and worker.checkpoints.noticed
    assert worker.run() == 0
    for q in qs:
        h = queue.r.hgetall(keys.query(q.gid))
        assert h["state"] == "queued" and int(h.get("attempts", 0)) == 0
        assert partial(queue, q.gid) == generated[q.gid]  # the ids and the text
    Offloader(queue).tick()
    b = make_worker(queue, "b")
    assert b.run(max_queries=3) == 3
    assert (b.resumed_queries, b.resumed_tokens) == (3, 30)
    native = engine()
    for row in results(queue, "b1"):
        i = int(row.query_id[1:])
        [whole] = native.generate([Request(row.query_id, PROMPTS[i], SamplingParams(max_tokens=32))])
        assert (row.text, row.completion_tokens, row.prompt_tokens, row.finish_reason) == (
            whole.text,
            whole.completion_tokens,
            whole.prompt_tokens,
            whole.finish_reason,
        )
        assert row.attempts == 1
    assert check(queue.r) == []


def test_the_gpu_checks_resume_comparison_runs_on_the_stand_in(parts):
    """``scripts/gpu-check.sh``'s vLLM check compares a continued answer with the whole one on the real vLLM; its
    comparison, here on the stand-in."""
    from engines.bench.gpu_check_vllm import resume_check

    model, tok = parts
    got = resume_check(StandInLLM(model, tok), tok, 16, sampling=dict)
    assert got == {
        "cut_tokens": 5,
        "ids_equal": True,
        "text_equal": True,
        "first_difference": None,
        "completion_tokens": [16, 16],
        "prompt_tokens": [got["prompt_tokens"][0]] * 2,
    }
