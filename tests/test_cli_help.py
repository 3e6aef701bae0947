"""Every part of `fleetbatch` explains itself, and so does every subcommand; bad input gets a message, not a traceback."""

from __future__ import annotations

import importlib
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from fleetbatch.cli import PARTS

MODULES = {name: module for name, (module, _) in PARTS.items()}


def call(module: str, args: list[str], capsys) -> tuple[int, str, str]:
    main = importlib.import_module(module).main
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err


def subcommands(help_text: str) -> list[str]:
    """The subcommand names listed as ``{a,b,c}`` in a top-level help text."""
    match = re.search(r"\{([A-Za-z0-9_,\-]+)\}", help_text)
    return match.group(1).split(",") if match else []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_help_explains_every_subcommand(name, capsys):
    installed = (Path(sys.executable).parent / "fleetbatch").exists() or shutil.which("fleetbatch")
    assert installed, "the console script fleetbatch is not installed"
    code, out, _ = call(MODULES[name], ["--help"], capsys)
    assert code == 0 and "usage:" in out and len(out) > 200
    subs = subcommands(out)
    assert subs, f"{name} lists no subcommands"
    for sub in subs:
        code, sub_out, err = call(MODULES[name], [sub, "--help"], capsys)
        assert code == 0, f"{name} {sub} --help failed: {err[-500:]}"
        assert "usage:" in sub_out


@pytest.mark.parametrize("name", sorted(MODULES))
def test_unknown_subcommand_is_an_error_not_a_crash(name, capsys):
    code, _, err = call(MODULES[name], ["no-such-command"], capsys)
    assert code != 0 and "invalid choice" in err


def test_fleetbatch_is_the_package_s_one_console_script():
    """pyproject's [project.scripts] names one command, whose parts are the CLI modules (``pip install -e .``)."""
    scripts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    assert scripts == {"fleetbatch": "fleetbatch.cli:main"}
    assert set(MODULES) == {"gateway", "engine", "planner", "predictor", "quant", "loadgen", "sim"}
