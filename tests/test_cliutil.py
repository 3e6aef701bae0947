"""The shared ``main()`` of the console scripts: exit codes, error messages, JSON results, Ctrl-C."""

from __future__ import annotations

import argparse
import json

import pytest

from cliutil import run_main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tool")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("go").add_argument("--fail", default="")
    return p


def run(args: argparse.Namespace):
    if args.fail == "value":
        raise ValueError("bad value")
    if args.fail == "key":
        raise KeyError("a bug")
    if args.fail == "interrupt":
        raise KeyboardInterrupt
    return {"ok": True}


def test_an_expected_error_is_a_message_and_an_exit_code(capsys):
    assert run_main(parser(), ["go", "--fail", "value"], run, prog="tool", log_format=None) == 1
    assert capsys.readouterr().err.strip() == "tool go: error: bad value"
    code = run_main(
        parser(), ["go", "--fail", "value"], run, prog="tool", error_code=3, message="{prog}: {error}!"
    )
    assert code == 3 and capsys.readouterr().err.strip() == "tool: bad value!"


def test_other_errors_keep_their_traceback():
    with pytest.raises(KeyError):
        run_main(parser(), ["go", "--fail", "key"], run, prog="tool", log_format=None)


def test_results_print_as_one_json_line_or_return_the_exit_code(capsys):
    assert run_main(parser(), ["go"], run, prog="tool", log_format=None, print_json=True) == 0
    assert json.loads(capsys.readouterr().out) == {"ok": True}
    assert run_main(parser(), ["go"], lambda a: 3, prog="tool", log_format=None) == 3


def test_ctrl_c_gives_the_interrupted_code_only_when_asked(capsys):
    argv = ["go", "--fail", "interrupt"]
    assert run_main(parser(), argv, run, prog="tool", log_format=None, interrupted_code=130) == 130
    assert "tool: interrupted" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        run_main(parser(), argv, run, prog="tool", log_format=None)


def test_without_a_subcommand_the_message_names_the_program_alone(capsys):
    def fail(_args):
        raise FileNotFoundError("no such file")

    plain = argparse.ArgumentParser(prog="tool")
    assert run_main(plain, [], fail, prog="tool") == 1
    assert capsys.readouterr().err.strip() == "tool: error: no such file"
