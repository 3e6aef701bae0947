"""``--config-file``: a command's options from a YAML file and the environment, under the flags.

A command that offers it calls :func:`enable_config_file` on its parser once every option is added.
Each option then resolves, highest first, from:

1. its flag on the command line;
2. the environment variable ``FLEETBATCH_<DEST>`` (the option's name in capitals, ``-`` as ``_``:
   ``--redis-url`` is ``FLEETBATCH_REDIS_URL``);
3. the config file's key ``<dest>`` (``redis_url: redis://...``; ``--config-file`` or
   ``FLEETBATCH_CONFIG_FILE`` names the file);
4. the option's default.

The file and the variables are checked against :func:`options_model`, a pydantic model built from the
parser's own options (their types, choices and repeatable ones as lists), so an unknown key or a bad
value is refused by name, and the reference documents exactly what the parser accepts.
:func:`resolve_config` (called by :func:`cliutil.run_main`) fills in the values after parsing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model

ENV_PREFIX = "FLEETBATCH_"
CONFIG_DEST = "config_file"
#: options a config file never sets
_SKIPPED = {"help", "version", CONFIG_DEST}


class ConfigFileError(ValueError):
    """A config file or environment variable that does not fit the command's options."""


class _Unset:
    """The default of an option not given on the command line: resolved later from env, file or default."""

    def __init__(
        self,
        action: argparse.Action,
        default: Any,
        options: tuple[argparse.Action, ...],
        exempt: frozenset[str],
        required: bool,
    ) -> None:
        self.action, self.default, self.options, self.exempt = action, default, options, exempt
        self.required = required

    def __str__(self) -> str:  # what --help shows as %(default)s
        return str(self.default)

    __repr__ = __str__

    def __copy__(self) -> list:
        """A repeatable option's flags start a new list: argparse's append action copies the default
        before adding to it, and flags replace the environment's and the file's list, whole."""
        return []


def env_name(dest: str) -> str:
    """The environment variable of an option: ``FLEETBATCH_`` + its name in capitals."""
    return ENV_PREFIX + dest.upper()


def _options(parser: argparse.ArgumentParser) -> tuple[argparse.Action, ...]:
    return tuple(
        a for a in parser._actions
        if a.option_strings and a.dest not in _SKIPPED and not isinstance(a, argparse._SubParsersAction)
    )  # fmt: skip


def _field_type(a: argparse.Action) -> Any:
    if isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return bool
    base: Any = a.type if a.type in (int, float, str) else str
    if a.choices is not None:
        base = Literal[tuple(a.choices)]
    elif a.type is not None and a.type not in (int, float, str) and callable(a.type):
        convert = a.type
        base = Annotated[str, AfterValidator(lambda v: convert(v))]
    if isinstance(a, argparse._AppendAction) or a.nargs in ("+", "*") or isinstance(a.nargs, int):
        base = list[base]
    return base | None


def options_model(
    parser_or_options: argparse.ArgumentParser | Iterable[argparse.Action], name: str
) -> type[BaseModel]:
    """A pydantic model of a command's options: one optional field per option, unknown keys refused."""
    actions = (
        _options(parser_or_options)
        if isinstance(parser_or_options, argparse.ArgumentParser)
        else tuple(parser_or_options)
    )
    fields = {a.dest: (_field_type(a), Field(None, description=a.help)) for a in actions}
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


def enable_config_file(parser: argparse.ArgumentParser, env_exempt: Iterable[str] = ()) -> None:
    """Add ``--config-file`` and let every option of ``parser`` come from the environment or that file.

    ``env_exempt``: options whose variable already means something else (``FLEETBATCH_CLIENT_TOKENS``
    is the gateway's token table itself, where ``--client-tokens`` names a file of it); they come from
    the flag, the file or the default only.
    """
    parser.add_argument(
        "--config-file",
        metavar="FILE",
        default=None,
        help=f"YAML file of these options (keys: the options' names with _ for -); {ENV_PREFIX}<NAME> "
        f"environment variables override it, flags override both (default: ${env_name(CONFIG_DEST)})",
    )
    options = _options(parser)
    exempt = frozenset(env_exempt)
    for a in options:
        a.default = _Unset(a, a.default, options, exempt, a.required)
        a.required = False  # it may come from the environment or the file: resolve_config checks it


def _converted(a: argparse.Action, default: Any) -> Any:
    """An option's default as argparse would give it (a string default goes through the type)."""
    if isinstance(default, str) and callable(a.type):
        return a.type(default)
    return default


def _env_values(
    options: tuple[argparse.Action, ...], exempt: frozenset[str], environ: Mapping[str, str]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in options:
        raw = None if a.dest in exempt else environ.get(env_name(a.dest))
        if raw is None:
            continue
        # a list: an appending option, or one that takes values (an on/off flag takes none: nargs 0, one value)
        many = a.nargs in ("+", "*") or (isinstance(a.nargs, int) and a.nargs >= 1)
        listy = isinstance(a, argparse._AppendAction) or many
        if listy:
            out[a.dest] = json.loads(raw) if raw.lstrip().startswith("[") else shlex.split(raw)
        else:
            out[a.dest] = raw
    return out


def _validated(model: type[BaseModel], data: dict[str, Any], source: str) -> dict[str, Any]:
    try:
        checked = model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'the file'}: "
            f"{'unknown option' if err['type'] == 'extra_forbidden' else err['msg']}"
            for err in e.errors()
        )
        raise ConfigFileError(f"{source}: {problems}") from None
    return {k: getattr(checked, k) for k in data}


def _file_values(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigFileError(f"config file {p} not found") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigFileError(f"config file {p}: cannot read it as YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {p}: expected a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def resolve_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Fill every option not given as a flag from the environment, the config file or its default."""
    unset = {k: v for k, v in vars(args).items() if isinstance(v, _Unset)}
    if not unset:
        return args
    environ = os.environ if environ is None else environ
    first = next(iter(unset.values()))
    options = first.options
    model = options_model(options, "Options")
    path = getattr(args, CONFIG_DEST, None) or environ.get(env_name(CONFIG_DEST))
    from_file = _validated(model, _file_values(path), f"config file {path}") if path else {}
    from_env = _validated(model, _env_values(options, first.exempt, environ), "environment")
    for dest, value in unset.items():
        if dest in from_env:
            setattr(args, dest, from_env[dest])
        elif dest in from_file:
            setattr(args, dest, from_file[dest])
        elif value.required:
            raise ConfigFileError(
                f"{'/'.join(value.action.option_strings)} is required: give the flag, {env_name(dest)} "
                f"or '{dest}' in the config file"
            )
        else:
            setattr(args, dest, _converted(value.action, value.default))
    return args
