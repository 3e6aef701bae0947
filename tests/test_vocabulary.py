"""One vocabulary: every flag of the `fleetbatch` tree is in the table, means one thing, and no renamed flag is
left, in the parsers or in the commands the docs show."""

from __future__ import annotations

import argparse
import re

import pytest

from cliutil import env_name
from fleetbatch.cli import full_parser
from fleetbatch.vocabulary import COUNTS, PATHS, RETIRED, SHORT, VOCABULARY
from tests.harness import REPO
from tests.test_cli_tree import commands

#: the docs whose commands must parse today (the benchmark log keeps the commands of its day; the generated
#: reference is the parsers themselves)
DOCS = [
    p
    for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "k8s" / "README.md"]
    if p.name != "benchmarks-log.md" and "reference" not in p.relative_to(REPO).parts
]


@pytest.fixture(scope="module")
def options() -> list[tuple[str, argparse.Action]]:
    """Every option of the tree, with the command it belongs to."""
    out = []
    for path, parser in commands(full_parser()).items():
        for a in parser._actions:
            if a.option_strings and a.dest != "help":
                out.append((" ".join(("fleetbatch", *path)), a))
    return out


def _long(a: argparse.Action) -> str:
    return next(o for o in a.option_strings if o.startswith("--"))


def test_every_flag_is_in_the_table_and_every_entry_is_used(options):
    used = {_long(a) for _, a in options}
    assert not sorted(used - set(VOCABULARY)), "flags missing from fleetbatch/vocabulary.py"
    assert not sorted(set(VOCABULARY) - used), "table entries no command has"
    assert all(meaning.strip() for meaning in VOCABULARY.values())


def test_short_options_are_aliases_of_one_long_option_each(options):
    for command, a in options:
        for short in (o for o in a.option_strings if not o.startswith("--")):
            assert SHORT.get(short) == _long(a), f"{command}: {short} is {_long(a)}, not {SHORT.get(short)}"


def test_no_retired_flag_is_left(options):
    left = sorted({f"{command} {o}" for command, a in options for o in a.option_strings if o in RETIRED})
    assert not left


def test_counts_take_numbers_and_paths_take_paths_everywhere(options):
    for command, a in options:
        flag = _long(a)
        if flag in COUNTS:
            assert a.nargs != 0 and callable(a.type) and a.type("3") is not None, f"{command} {flag}"
        if flag in PATHS:
            assert a.type in (None, str) and a.nargs is None, f"{command} {flag} must take one path"


def test_every_flag_the_docs_show_is_an_option_of_its_command():
    tree = commands(full_parser())
    flags = {path: {o for a in p._actions for o in a.option_strings} for path, p in tree.items()}
    wrong, seen = [], 0
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            for m in re.finditer(r"fleetbatch ([a-z]+) ([a-z][a-z-]*)((?:(?!fleetbatch |`| #| \|).)*)", line):
                path = (m.group(1), m.group(2))
                if path not in flags:
                    continue  # test_cli_tree checks the commands themselves
                for flag in re.findall(r"(?<![=\w-])(--?[a-z][a-z0-9-]*)", m.group(3)):
                    seen += 1
                    if flag not in flags[path] and flag != "--help":
                        wrong.append(f"{doc.relative_to(REPO)}: fleetbatch {' '.join(path)} {flag}")
    assert seen > 100
    assert not wrong, sorted(set(wrong))


def test_the_config_file_commands_read_no_variable_that_means_something_else():
    """``gateway serve`` and ``engine serve`` take every option from FLEETBATCH_<OPTION>: such a name may be
    one the project already reads only where it means that option."""
    same_meaning = {
        "FLEETBATCH_REDIS_URL",
        "FLEETBATCH_ADMIN_TOKEN",
        "FLEETBATCH_HTTP_API_KEY",
        "FLEETBATCH_VERBOSE",
    }
    known = set()
    for path in REPO.glob("*/**/*.py"):
        if ".venv" not in path.parts and "tests" not in path.parts:
            known |= set(re.findall(r"\"(FLEETBATCH_[A-Z_]+)\"", path.read_text()))
    assert "FLEETBATCH_CLIENT_TOKENS" in known and "FLEETBATCH_DATA" in known
    tree = commands(full_parser())
    for path in (("gateway", "serve"), ("engine", "serve")):
        parser = tree[path]
        exempt = {"client_tokens"}
        for a in parser._actions:
            if a.option_strings and a.dest not in ("help", "config_file") and a.dest not in exempt:
                name = env_name(a.dest)
                assert name not in known or name in same_meaning, f"{' '.join(path)} {_long(a)}: {name}"
