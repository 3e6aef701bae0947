"""``--vllm-arg KEY=VALUE``: vLLM engine arguments a user sets, parsed and checked without importing vLLM.

``fleetbatch engine serve --backend vllm --vllm-arg KEY=VALUE`` (repeatable; ``vllm_arg: [KEY=VALUE, ...]``
in its ``--config-file``, or ``FLEETBATCH_VLLM_ARG``) passes ``KEY=VALUE`` to ``vllm.EngineArgs``. KEY is
an ``EngineArgs`` field, written with dashes or underscores (``max-model-len``, ``--max-model-len`` and
``max_model_len`` are one key); it is checked against :data:`engines.vllm_engine_args.ENGINE_ARGS`, the
fields of the pinned vLLM, so a misspelt key is refused, with the closest names, before vLLM is imported.
VALUE is JSON where it parses as JSON (``8192``, ``0.85``, ``true``, ``null``, ``[1, 2]``,
``{"level": 3}``, ``"1"`` for the string 1), else the string itself (``bfloat16``). A key given twice
takes its last value.
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Iterable
from typing import Any

from engines.vllm_engine_args import ENGINE_ARGS, VLLM_VERSIONS

FLAG = "--vllm-arg"


class DefaultCount(int):
    """An option's default number, told apart from the same number given (``--max-running``'s default 8
    is the native engine's batch; the vllm backend keeps vLLM's own ``max_num_seqs`` unless it is given)."""


def given(value: int | None) -> int | None:
    """``value`` where it was given (flag, environment or config file); None where it is the default."""
    return None if isinstance(value, DefaultCount) else value


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    """The vLLM backend's options (``--backend vllm``) of ``fleetbatch engine serve``."""
    g = p.add_argument_group(
        "the vllm backend (--backend vllm)",
        "vLLM's own defaults hold wherever neither a plan nor a flag sets a value: --max-running becomes "
        "max_num_seqs only when given, a plan its translation (docs/how-to/operating.md); --vllm-arg sets "
        "any engine argument and overrides both.",
    )
    g.add_argument(
        FLAG,
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help=f"an engine argument of vLLM (a vllm.EngineArgs field of vLLM {VLLM_VERSIONS[0]}, dashes or "
        "underscores; the value as JSON where it parses, else a string), e.g. max_model_len=8192 or "
        "dtype=bfloat16; repeatable; it overrides the plan's value and --max-running",
    )


def normalise_key(key: str) -> str:
    """An engine argument's name as ``EngineArgs`` spells it: ``--max-model-len`` -> ``max_model_len``."""
    return key.strip().removeprefix("--").replace("-", "_")


def parse_value(raw: str) -> Any:
    """A value as JSON where it parses (numbers, true/false/null, lists, objects, quoted strings), else the
    string itself."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def closest_keys(key: str, n: int = 3) -> list[str]:
    """The engine arguments whose names are closest to ``key`` (difflib), best first."""
    return difflib.get_close_matches(key, sorted(ENGINE_ARGS), n=n, cutoff=0.6)


def check_key(key: str) -> str:
    """``key`` normalised, or a ValueError naming it and the closest engine arguments."""
    name = normalise_key(key)
    if name in ENGINE_ARGS:
        return name
    near = closest_keys(name)
    hint = f"; did you mean {', '.join(near)}?" if near else " (none is close)"
    raise ValueError(
        f"{FLAG} {key}: not an engine argument of vLLM {'/'.join(VLLM_VERSIONS)} (vllm.EngineArgs){hint}"
    )


def parse_vllm_arg(text: str) -> tuple[str, Any]:
    """One ``KEY=VALUE`` -> (the checked EngineArgs field name, the parsed value)."""
    key, sep, raw = str(text).partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{FLAG} {text!r}: expected KEY=VALUE, e.g. {FLAG} max_model_len=8192")
    return check_key(key), parse_value(raw.strip())


def parse_vllm_args(items: Iterable[str] | None) -> dict[str, Any]:
    """Every ``--vllm-arg`` -> {field: value}; the last of a key given twice counts."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, value = parse_vllm_arg(item)
        out.pop(key, None)  # the last one counts, in its place
        out[key] = value
    return out


def override(base: dict[str, Any], user: dict[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """``base`` (what ``source`` set) with the user's arguments over it, and one line per key the user
    set: the value of ``source`` it overrides, or that it sets it."""
    merged = dict(base)
    said = []
    for key, value in user.items():
        if key in base and base[key] != value:
            said.append(f"{FLAG} {key}={json.dumps(value)} overrides {json.dumps(base[key])} from {source}")
        else:
            said.append(f"{FLAG} sets {key}={json.dumps(value)}")
        merged[key] = value
    return merged, said
