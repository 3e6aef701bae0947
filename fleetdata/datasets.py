"""Readers for the real prompt/response datasets (``../shared/data``) and generic JSONL.

Every reader yields :class:`Record` objects: a prompt, the recorded response text (or
only its length), and the source name. Lengths in tokens of a serving model's tokenizer
are computed later (see :func:`response_lengths`); word counts are available without a
tokenizer. The data directory comes from ``$FLEETBATCH_DATA`` or defaults to
``../shared/data`` beside the repository; nothing here copies dataset text into the repo.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DATA_ENV = "FLEETBATCH_DATA"

ALPACA_EVAL_MODELS = (
    "llama-2-7b-chat-hf",
    "llama-2-13b-chat-hf",
    "llama-2-70b-chat-hf",
    "Meta-Llama-3-8B-Instruct",
    "Mistral-7B-Instruct-v0.2",
    "vicuna-7b-v1.5",
    "Qwen1.5-7B-Chat",
    "alpaca-7b",
    "text_davinci_003",
    "gpt4_0613",
)

#: Sources of the mixed workload (issue [2/9]): alpaca_eval with llama-2-7b answers,
#: gsm8k train, code_alpaca, gpteacher roleplay and toolformer.
MIXED_SOURCES = ("alpaca_eval", "gsm8k", "code_alpaca", "roleplay", "toolformer")


@dataclass(frozen=True)
class Record:
    """One prompt with its recorded response (``response`` may be empty when only ``length`` is known)."""

    prompt: str
    response: str
    source: str
    length: int | None = None  # response length in tokens when known without text
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def words(self) -> int:
        """Response length in whitespace-separated words (tokenizer-free proxy)."""
        if self.length is not None and not self.response:
            return self.length
        return len(self.response.split())


def data_dir(path: str | os.PathLike | None = None) -> Path:
    """Resolve the shared data directory: explicit path, then ``$FLEETBATCH_DATA``, then ``../shared/data``."""
    if path is not None:
        p = Path(path)
    elif os.environ.get(DATA_ENV):
        p = Path(os.environ[DATA_ENV])
    else:
        repo = Path(__file__).resolve().parent.parent
        candidates = [repo.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
        p = next((c for c in candidates if c.is_dir()), candidates[0])
    if not p.is_dir():
        raise FileNotFoundError(f"dataset directory {p} not found; set ${DATA_ENV} or pass --data-dir")
    return p


def _join(instruction: str, inp: str) -> str:
    instruction = (instruction or "").strip()
    inp = (inp or "").strip()
    return f"{instruction}\n\n{inp}" if inp else instruction


def _read_json(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _read_jsonl(path: Path) -> Iterator[dict]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e


def alpaca_eval_models(root: Path | None = None) -> list[str]:
    """The models with an answer file (``alpaca_eval/<model>.json``) in the data directory."""
    return sorted(p.stem for p in (data_dir(root) / "alpaca_eval").glob("*.json"))


def load_alpaca_eval(model: str = "llama-2-7b-chat-hf", root: Path | None = None) -> list[Record]:
    """alpaca_eval prompts with the answers of ``model``: any ``alpaca_eval/<model>.json`` in the data directory."""
    if not model or "/" in model or "\\" in model or model.startswith("."):
        raise ValueError(f"{model!r} is not an alpaca_eval model name")
    path = data_dir(root) / "alpaca_eval" / f"{model}.json"
    if not path.is_file():
        present = alpaca_eval_models(root) or list(ALPACA_EVAL_MODELS)
        raise FileNotFoundError(
            f"no alpaca_eval answers of {model!r} ({path}); choose one of {', '.join(present)}"
        )
    rows = _read_json(path)
    return [
        Record(r["instruction"], r["output"] or "", "alpaca_eval", meta={"generator": model}) for r in rows
    ]


def load_gsm8k(split: str = "train", root: Path | None = None) -> list[Record]:
    if split not in ("train", "test"):
        raise ValueError(f"gsm8k split must be 'train' or 'test', not {split!r}")
    return [
        Record(r["question"], r["answer"], "gsm8k")
        for r in _read_jsonl(data_dir(root) / "gsm8k" / f"{split}.jsonl")
    ]


def load_code_alpaca(root: Path | None = None) -> list[Record]:
    rows = _read_json(data_dir(root) / "code_alpaca" / "code_alpaca_2k.json")
    return [Record(_join(r["instruction"], r.get("input", "")), r["output"], "code_alpaca") for r in rows]


def load_gpteacher(kind: str = "roleplay", root: Path | None = None) -> list[Record]:
    if kind not in ("roleplay", "toolformer"):
        raise ValueError(f"gpteacher kind must be 'roleplay' or 'toolformer', not {kind!r}")
    rows = _read_json(data_dir(root) / "gpteacher" / f"{kind}.json")
    return [Record(_join(r["instruction"], r.get("input", "")), r["output"], kind) for r in rows]


def load_azure_trace(kind: str = "conv", root: Path | None = None) -> list[dict]:
    """Azure production trace rows: ``{"timestamp": str, "context_tokens": int, "generated_tokens": int}``."""
    if kind not in ("conv", "code"):
        raise ValueError(f"azure trace kind must be 'conv' or 'code', not {kind!r}")
    path = data_dir(root) / "azure_trace" / f"AzureLLMInferenceTrace_{kind}.csv"
    with path.open(newline="") as f:
        return [
            {
                "timestamp": r["TIMESTAMP"],
                "context_tokens": int(r["ContextTokens"]),
                "generated_tokens": int(r["GeneratedTokens"]),
            }
            for r in csv.DictReader(f)
        ]


def load_source(name: str, root: Path | None = None) -> list[Record]:
    """Load one named source: a member of :data:`MIXED_SOURCES`, ``gsm8k_test``, or ``alpaca_eval:<model>``."""
    if name.startswith("alpaca_eval:"):
        return load_alpaca_eval(name.split(":", 1)[1], root)
    loaders = {
        "alpaca_eval": lambda: load_alpaca_eval("llama-2-7b-chat-hf", root),
        "gsm8k": lambda: load_gsm8k("train", root),
        "gsm8k_test": lambda: load_gsm8k("test", root),
        "code_alpaca": lambda: load_code_alpaca(root),
        "roleplay": lambda: load_gpteacher("roleplay", root),
        "toolformer": lambda: load_gpteacher("toolformer", root),
    }
    if name not in loaders:
        raise ValueError(
            f"unknown dataset {name!r}; choose one of {', '.join(loaders)}, mixed, or alpaca_eval:<model>"
        )
    return loaders[name]()


def load_mixed(root: Path | None = None, sources: Sequence[str] = MIXED_SOURCES) -> list[Record]:
    """The mixed workload: every source of :data:`MIXED_SOURCES`, in a fixed order, empty prompts dropped."""
    out: list[Record] = []
    for s in sources:
        out.extend(r for r in load_source(s, root) if r.prompt.strip())
    return out


def load_dataset(name: str, root: Path | None = None) -> list[Record]:
    """``mixed`` or any name accepted by :func:`load_source`."""
    return load_mixed(root) if name == "mixed" else [r for r in load_source(name, root) if r.prompt.strip()]


def load_jsonl(path: str | os.PathLike) -> list[Record]:
    """Generic JSONL: each line ``{"prompt", "response"}`` or ``{"prompt", "length"}`` (optional ``source``)."""
    out = []
    for i, row in enumerate(_read_jsonl(Path(path)), 1):
        if "prompt" not in row:
            raise ValueError(f"{path}: line {i} has no 'prompt' field")
        if "response" in row:
            out.append(Record(row["prompt"], row["response"], row.get("source", "jsonl")))
        elif "length" in row:
            out.append(Record(row["prompt"], "", row.get("source", "jsonl"), length=int(row["length"])))
        else:
            raise ValueError(f"{path}: line {i} needs 'response' or 'length'")
    return out


def response_lengths(records: Iterable[Record], tokenizer=None, batch_size: int = 256) -> list[int]:
    """Response length of each record in tokens of ``tokenizer`` (words when ``tokenizer`` is None)."""
    records = list(records)
    if tokenizer is None:
        return [r.words() for r in records]
    out: list[int] = [0] * len(records)
    texts: list[tuple[int, str]] = []
    for i, r in enumerate(records):
        if r.length is not None and not r.response:
            out[i] = r.length
        else:
            texts.append((i, r.response))
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        enc = tokenizer([t for _, t in chunk], add_special_tokens=False)["input_ids"]
        for (i, _), ids in zip(chunk, enc, strict=True):
            out[i] = len(ids)
    return out
