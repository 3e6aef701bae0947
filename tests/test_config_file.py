"""``--config-file``: options from a YAML file and FLEETBATCH_<OPTION> variables, flags over both."""

from __future__ import annotations

import argparse

import pytest

from cliutil import ConfigFileError, enable_config_file, run_main
from cliutil.config_file import resolve_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    p.add_argument("--listen", default="127.0.0.1:50051", help="where")
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--no-offload", action="store_true")
    p.add_argument("--policy", choices=("token", "fifo"), default="token")
    p.add_argument("--engine-arg", action="append")
    p.add_argument("--pair", type=lambda s: tuple(int(x) for x in s.split(",")), default="1,2")
    p.add_argument("--client-tokens", default=None)
    p.add_argument("--cluster", required=True)
    enable_config_file(p, env_exempt=("client_tokens",))
    return p


def _args(argv, environ, tmp_path=None, text=None) -> argparse.Namespace:
    if text is not None:
        (tmp_path / "c.yaml").write_text(text)
        argv = [*argv, "--config-file", str(tmp_path / "c.yaml")]
    environ = {"FLEETBATCH_CLUSTER": "c", **environ}
    return resolve_config(_parser().parse_args(argv), environ)


def test_flags_over_environment_over_file_over_defaults(tmp_path):
    text = "listen: 0.0.0.0:1\nmax_running: 3\nratio: 2\nno-offload: true\nengine_arg: [--a, b]\n"
    a = _args([], {}, tmp_path, text)
    assert (a.listen, a.max_running, a.ratio, a.no_offload, a.engine_arg) == (
        "0.0.0.0:1",
        3,
        2.0,
        True,
        ["--a", "b"],
    )
    assert (a.policy, a.pair) == ("token", (1, 2))  # defaults, the string one through its type
    env = {"FLEETBATCH_MAX_RUNNING": "5", "FLEETBATCH_POLICY": "fifo", "FLEETBATCH_ENGINE_ARG": "--x y"}
    a = _args([], env, tmp_path, text)
    assert (a.max_running, a.policy, a.engine_arg, a.listen) == (5, "fifo", ["--x", "y"], "0.0.0.0:1")
    a = _args(["--max-running", "9", "--pair", "3,4"], env, tmp_path, text)
    assert (a.max_running, a.pair) == (9, (3, 4))


@pytest.mark.parametrize(
    "raw, want", [("true", True), ("1", True), ("yes", True), ("false", False), ("0", False)]
)
def test_an_on_off_option_comes_from_its_variable(raw, want, tmp_path):
    """FLEETBATCH_NO_AUTH=true, as a container sets it: an on/off flag's variable is one value, not a list."""
    assert _args([], {"FLEETBATCH_NO_OFFLOAD": raw}).no_offload is want
    assert (
        _args(
            [], {"FLEETBATCH_NO_OFFLOAD": raw}, tmp_path, f"no_offload: {str(not want).lower()}\n"
        ).no_offload
        is want
    )
    with pytest.raises(ConfigFileError, match="environment: no_offload"):
        _args([], {"FLEETBATCH_NO_OFFLOAD": "maybe"})


def test_no_file_and_no_environment_gives_the_parsers_defaults():
    a = _args([], {})
    assert (a.listen, a.max_running, a.no_offload, a.engine_arg, a.config_file) == (
        "127.0.0.1:50051",
        8,
        False,
        None,
        None,
    )


def test_the_file_may_come_from_the_environment_and_exempt_options_ignore_theirs(tmp_path):
    (tmp_path / "c.yaml").write_text("max_running: 4\n")
    env = {"FLEETBATCH_CONFIG_FILE": str(tmp_path / "c.yaml"), "FLEETBATCH_CLIENT_TOKENS": "ci:secret"}
    a = _args([], env)
    assert a.max_running == 4 and a.client_tokens is None


@pytest.mark.parametrize(
    ("text", "env", "named"),
    [
        ("max_runing: 3\n", {}, "max_runing: unknown option"),
        ("max_running: many\n", {}, "max_running"),
        ("policy: random\n", {}, "policy"),
        ("- a\n", {}, "expected a mapping"),
        ("", {"FLEETBATCH_RATIO": "fast"}, "environment: ratio"),
    ],
)
def test_bad_keys_and_values_are_refused_by_name(tmp_path, text, env, named):
    with pytest.raises(ConfigFileError, match=named):
        _args([], env, tmp_path, text)


def test_a_required_option_may_come_from_the_file_or_the_environment_but_must_come(tmp_path):
    assert _args([], {}, tmp_path, "cluster: from-file\n").cluster == "c"  # the variable is over the file
    a = resolve_config(_parser().parse_args(["--config-file", str(tmp_path / "c.yaml")]), {})
    assert a.cluster == "from-file"
    with pytest.raises(ConfigFileError, match="--cluster is required: give the flag, FLEETBATCH_CLUSTER"):
        resolve_config(_parser().parse_args([]), {})


def test_run_main_turns_a_bad_file_into_exit_1_with_the_key_named(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("lisen: x\n")
    code = run_main(
        _parser(), ["--config-file", str(tmp_path / "c.yaml")], lambda a: 0, prog="t", log_format=None
    )
    assert code == 1 and "lisen: unknown option" in capsys.readouterr().err
    assert (
        run_main(
            _parser(), ["--config-file", str(tmp_path / "none.yaml"), "--cluster", "c"], lambda a: 0, prog="t"
        )
        == 1
    )
    assert "not found" in capsys.readouterr().err


def test_help_shows_the_real_defaults(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    assert "_Unset" not in capsys.readouterr().out
