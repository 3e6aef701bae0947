"""One command, `fleetbatch`: every part is a subcommand, no other console script is installed, the whole
`--help` tree answers, every command the docs name exists, and exit codes mean one thing everywhere (2 a
usage error, 1 any other failure)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from importlib.metadata import distribution

import pytest

from fleetbatch.cli import PARTS, full_parser, main
from tests.harness import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "k8s" / "README.md"]


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command of the tree, by its words after `fleetbatch`."""
    out = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(commands(sub, (*path, name)))
    return out


@pytest.fixture(scope="module")
def tree() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    return commands(full_parser())


def test_fleetbatch_is_the_only_console_script():
    scripts = [e.name for e in distribution("fleetbatch").entry_points if e.group == "console_scripts"]
    assert scripts == ["fleetbatch"]


def test_the_help_lists_every_part():
    out = subprocess.run(
        [sys.executable, "-m", "fleetbatch.cli", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0
    for part in [*PARTS, "completion"]:
        assert re.search(rf"^\s+{part}\s", out.stdout, re.M), part


def test_every_command_of_the_tree_has_help_named_as_it_is_run(tree):
    assert {path[0] for path in tree if path} == {*PARTS, "completion"}
    leaves = [p for p in tree if p and p[0] != "completion" and len(p) >= 2]
    assert len(leaves) >= 40
    for path, parser in tree.items():
        if len(path) >= 2:  # a part's own parsers carry their full name
            assert parser.prog == "fleetbatch " + " ".join(path), parser.prog
        assert parser.format_help()


def test_every_command_the_docs_name_exists(tree):
    named = set()
    for doc in DOCS:
        for m in re.finditer(r"fleetbatch ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)?)", doc.read_text()):
            words = tuple(m.group(1).split())
            if words[0] in PARTS:
                named.add((doc.name, words))
    assert len(named) > 50
    missing = []
    for doc, words in sorted(named):
        part_commands = {p[1] for p in tree if len(p) == 2 and p[0] == words[0]}
        if len(words) == 2 and part_commands and words[1] not in part_commands:
            missing.append(f"{doc}: fleetbatch {' '.join(words)}")
    assert not missing, missing


def test_a_usage_error_exits_2_and_any_other_failure_1(tmp_path, capsys):
    with pytest.raises(SystemExit) as usage:  # argparse's own
        main(["gateway", "serve", "--no-such-flag"])
    assert usage.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit) as unknown:
        main(["nowhere"])
    assert unknown.value.code == 2
    assert main(["engine", "generate", str(tmp_path / "missing.jsonl"), "--size", "nano"]) == 1
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["loadgen", "report", str(tmp_path / "no-run-dir")]) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["loadgen", "submit", "--target", "127.0.0.1:1", "--jsonl", str(bad)]) == 1
    assert "bad.jsonl:1: not valid JSON" in capsys.readouterr().err


def test_global_options_reach_the_part_by_the_environment(tmp_path):
    """`-v --log-format json` before the part: the planner, which logs warnings only by default, logs its
    progress (INFO), as JSON lines."""
    argv = ["-v", "--log-format", "json", "planner", "plan", "--cluster-spec", "1xT4", "--shape", "llama:micro",
            "--output-tokens", "64", "--out", str(tmp_path / "plan.json")]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "fleetbatch.cli", *argv], capture_output=True, text=True,
                         cwd=REPO, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    assert any(
        line["level"] == "INFO" and line["message"].startswith("planning llama:micro") for line in lines
    )
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)


def test_completion_scripts_cover_the_tree(tree, capsys):
    assert main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    for word in ("gateway", "rebalance", "file-soak", "--served-model"):
        assert word in script
    assert main(["completion", "fish"]) == 2  # not a shell shtab writes for


@pytest.mark.parametrize("command", ["serve", "up"])
def test_a_negative_http_port_turns_the_http_front_off_for_serve_and_up_alike(command):
    """`fleetbatch gateway serve --http-port -1` once tried to start the front on port -1 and asked for its key,
    where `gateway up --http-port -1` turned it off, as docs/design/gateway.md says."""
    from cliutil.config_file import resolve_config
    from gateway.cli import build_parser
    from gateway.config import GatewayConfig

    args = resolve_config(build_parser().parse_args([command, "--http-port", "-1"]), {})
    config = GatewayConfig.from_args(args, redis_url="redis://unused", admin_token="", clusters=[])
    assert config.http_port is None
    on = GatewayConfig.from_args(resolve_config(build_parser().parse_args([command, "--http-port", "0"]), {}), redis_url="redis://unused",
                                 admin_token="", clusters=[])  # fmt: skip
    assert on.http_port == 0


def test_every_docs_page_the_code_names_exists():
    """Help texts and docstrings point at docs pages; a page that moved leaves them pointing nowhere."""
    missing = []
    for path in sorted(REPO.glob("*/**/*.py")):
        if ".venv" in path.parts or "site-packages" in path.parts:
            continue
        for page in set(re.findall(r"\bdocs/[\w/.-]+?\.(?:md|png)\b", path.read_text(errors="replace"))):
            if not (REPO / page).exists():
                missing.append(f"{path.relative_to(REPO)}: {page}")
    assert not missing, missing
