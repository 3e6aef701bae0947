"""What the GPU check serves: a random local model saved as a Hugging Face directory, an uneven plan for it, prompts.

Nothing is downloaded (the GPU machine reaches nothing outside it): the tokenizer is trained
on generated text (:func:`localmodels.generated_corpus`), the model is a random-weight Llama
of a local size, and both are saved to a directory that the native engine and vLLM load
alike. The plan is written here with :mod:`planfile` (the engines do not import the
planner): two stages with an uneven layer split, every layer at 16 bits, on two devices
named ``gpu0`` and ``gpu1`` (one physical GPU may stand for both: see the checks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from localmodels import SIZES, build_model, default_tokenizer, generated_corpus
from planfile import Plan, StagePlan, save_plan


@dataclass(frozen=True)
class Workload:
    """The check's queries: ``queries`` prompts of ``prompt_len`` tokens, each forced to ``gen_len`` tokens;
    the first ``compare`` of them, forced to ``compare_len`` tokens, are compared with the CPU."""

    size: str = "small"
    vocab: int = 8192
    queries: int = 64
    prompt_len: int = 64
    gen_len: int = 64
    compare: int = 4
    compare_len: int = 16

    def to_dict(self) -> dict:
        return asdict(self)


#: the CPU dry run: the smallest model with an uneven 2-stage split (4 layers: 1 + 3), few tokens
DRY_RUN = Workload(size="tiny", vocab=1024, queries=4, prompt_len=16, gen_len=4, compare=2, compare_len=4)


def uneven_cuts(layers: int) -> list[int]:
    """An uneven 2-stage split: the first stage holds fewer layers (3 of 8, 1 of 4)."""
    if layers < 3:
        raise ValueError(f"an uneven 2-stage split needs at least 3 layers, the model has {layers}")
    first = max(1, (3 * layers) // 8)
    return [0, first, layers]


def write_plan(path: Path, w: Workload, vocab: int) -> Plan:
    """A 2-stage plan for llama:``w.size`` (``vocab`` tokens) with an uneven layer split, all layers at 16 bits."""
    hidden, layers, heads, kv_heads, inter = SIZES[w.size]
    cuts = uneven_cuts(layers)
    devices = [
        {"name": f"gpu{k}", "type": "GPU", "memory_bytes": 64 << 30, "node": "local", "slowdown": 0.0}
        for k in range(2)
    ]
    stages = [
        StagePlan(k, cuts[k], cuts[k + 1], [16] * (cuts[k + 1] - cuts[k]), 10**8, 0.01, 0.001)
        for k in range(2)
    ]
    plan = Plan(
        model={
            "name": f"llama:{w.size}",
            "hidden": hidden,
            "layers": layers,
            "heads": heads,
            "kv_heads": kv_heads,
            "intermediate": inter,
            "vocab": vocab,
        },
        method="gpu-check (uneven split written by hand)",
        devices=devices,
        stages=stages,
        kv_bits=16,
        prefill_micro_batch=4,
        decode_micro_batch=max(1, w.queries // 2),  # x 2 stages = every query in the running batch
        batch_size=w.queries,
        prompt_len=w.prompt_len,
        expected_output_tokens=w.gen_len,
        theta=1.0,
        total_omega=0.0,
        predicted_batch_latency_s=1.0,
        predicted_throughput_tokens_per_s=1.0,
        solve_seconds=0.0,
    )
    save_plan(plan, path)
    return plan


def prepare(workdir: Path, w: Workload) -> tuple[Path, Path]:
    """Save the tokenizer and a random llama:``w.size`` to ``workdir/model`` and its plan to
    ``workdir/plan.json``; returns both paths."""
    tok = default_tokenizer(vocab_size=w.vocab, texts=generated_corpus(400 if w.vocab <= 1024 else 4000))
    model = build_model("llama", w.size, tokenizer=tok, seed=0)
    model_dir = workdir / "model"
    model.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    plan_path = workdir / "plan.json"
    write_plan(plan_path, w, len(tok))
    return model_dir, plan_path


def prompt_ids(tokenizer, w: Workload) -> list[list[int]]:
    """``w.queries`` prompts of exactly ``w.prompt_len`` token ids, from generated text (cycled where short)."""
    out = []
    for text in generated_corpus(w.queries, seed=7):
        ids = tokenizer(text)["input_ids"] or [0]
        out.append((ids * (w.prompt_len // len(ids) + 1))[: w.prompt_len])
    return out
