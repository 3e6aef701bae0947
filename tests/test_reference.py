"""The docs site: the generated reference pages (``docs/reference/``) are what ``fleetbatch.reference`` renders
from the code today, the command-line page reads the same on every machine, and ``mkdocs build --strict``
builds the whole site with every relative link and anchor checked."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleetbatch import reference

REPO = Path(__file__).resolve().parent.parent


def _mkdocs() -> str | None:
    for candidate in (Path(sys.executable).parent / "mkdocs", REPO / ".venv" / "bin" / "mkdocs"):
        if candidate.is_file():
            return str(candidate)
    return shutil.which("mkdocs")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """``mkdocs build --strict`` into a temporary directory, started at once: it runs while the pages render."""
    exe = _mkdocs()
    if exe is None:
        yield None
        return
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.Popen([exe, "build", "--strict", "-d", str(out)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_the_generated_pages_on_disk_are_up_to_date(site):
    pages = reference.render()
    assert set(pages) >= {
        "reference/cli.md",
        "reference/grpc.md",
        "reference/metrics.md",
        "reference/http.md",
    }
    stale = reference.stale(pages, REPO / "docs")
    assert not stale, f"stale reference pages {stale}: run `python -m fleetbatch.reference` and commit them"


def test_the_site_builds_with_every_link_and_anchor_checked(site):
    if site is None:
        pytest.skip("mkdocs is not installed (pip install 'mkdocs>=1.6', part of the test extra)")
    proc, out = site
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, log[-5000:]
    for page in (
        "index.html",
        "reference/cli/index.html",
        "concepts/exactly-once/index.html",
        "status_page.png",
    ):
        assert (out / page).is_file(), page
    assert (out / "figures").is_dir()


def test_a_default_that_depends_on_the_machine_reads_so(monkeypatch):
    """A default taken from the CPU count or the home directory would make the page differ between machines."""

    def fake_part(name: str) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"fleetbatch {name}", description="a part made up for the test")
        run = p.add_subparsers(dest="command").add_parser("run", help="run it")
        run.add_argument("--threads", type=int, default=os.cpu_count(), help="threads (default %(default)s)")
        run.add_argument("--cache", default=str(Path.home() / ".cache" / "x"), help="where to cache")
        run.add_argument("--mode", choices=("a|b", "c"), default="c", help="one *plain* mode_or_other")
        run.add_argument("--name", required=True, help="a name")
        return p

    monkeypatch.setattr(reference, "PARTS", {"fake": ("fake.cli", "a made-up part")})
    monkeypatch.setattr(reference, "part_parser", fake_part)
    page = reference.cli_page()
    rows = {line.split(" | ")[0].strip("| `"): line for line in page.splitlines() if line.startswith("| `--")}
    assert rows["--threads THREADS"].endswith(
        "| (depends on the machine) | threads (default (depends on the machine)) |"
    )
    assert "| (depends on the machine) | where to cache |" in rows["--cache CACHE"]
    assert str(os.cpu_count()) not in rows["--threads THREADS"] and str(Path.home()) not in page
    assert rows["--name NAME"].endswith("| required | a name |")
    # a | in a code span would end the table cell: it is written as an entity; emphasis is escaped
    assert "<code>--mode {a&#124;b,c}</code> | `c` | one \\*plain\\* mode_or_other |" in page
    assert "### fleetbatch fake run" in page and "[`fleetbatch fake run`](#fleetbatch-fake-run)" in page


def test_comments_of_the_proto_file_attach_to_their_element():
    notes = reference.proto_comments(
        '// file comment\nsyntax = "proto3";\n// the service\nservice S {\n  // does it\n  rpc Do(A) returns (B);\n}\n'
        "message A { string x = 1; }\nmessage B {\n  // several\n  // lines\n  repeated int64 y = 1;  // and a tail\n"
        "  map<string, string> m = 2;\n}\nenum E {\n  E_UNSPECIFIED = 0;  // nothing\n}\n"
    )
    assert notes == {
        "S": "the service",
        "S.Do": "does it",
        "B.y": "several lines and a tail",
        "E.E_UNSPECIFIED": "nothing",
    }
