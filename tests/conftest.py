"""Shared fixtures: the real dataset directory and a real (embedded) Redis server; the run's order
(longest modules first, from ``tests/durations.json``)."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def data_root() -> Path:
    """``$FLEETBATCH_DATA`` or ``../shared/data``; tests that need it skip when it is missing."""
    p = Path(os.environ.get("FLEETBATCH_DATA", REPO.parent / "shared" / "data"))
    if not p.is_dir():
        pytest.skip(f"dataset directory {p} not found (set FLEETBATCH_DATA)")
    return p


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One embedded Redis server (a real redis-server process) per test session."""
    from workqueue.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), persist=False)
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session Redis, flushed before each test."""
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3-compatible server (moto's standalone server, a process of its own) per test session,
    started by the first test that asks for it (:mod:`tests.s3_server`)."""
    from tests.s3_server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3"))
    yield server
    server.close()


@pytest.fixture
def s3_files(s3_server, monkeypatch, request) -> str:
    """An ``s3://`` file store of its own (a new prefix) for one test, the ``AWS_*`` environment set to reach it."""
    import re
    import secrets

    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server.files_url(
        f"{re.sub(r'[^A-Za-z0-9_-]', '-', request.node.name)[:40]}-{secrets.token_hex(4)}"
    )


# -- the order of the run: the longest modules first ---------------------------------------------------
#
# Under pytest-xdist (scripts/test.sh: ``--dist loadgroup --no-loadscope-reorder``) each worker takes the next
# test (or the next group of tests marked ``xdist_group``, which share a costly fixture) when it is free, so a run ends soonest when the long tests start first and the short ones
# fill in at the end. ``tests/durations.json`` holds each test's seconds (set-up, call and tear-down;
# those of 1 s or more) from an earlier run: modules run in order of their summed seconds, longest
# first; the tests inside a module keep their order (module fixtures stay shared); a test the file
# does not know counts 0 s. ``pytest --store-durations`` writes the seconds of the tests it ran into
# the file (after a change that makes a module much slower or faster, or adds a slow one).

DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-durations",
        action="store_true",
        help=f"write the seconds of each test of 1 s or more to {DURATIONS.name} (the next runs' order)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    known: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    module_s: dict[str, float] = defaultdict(float)
    for item in items:
        module_s[item.nodeid.split("::")[0]] += known.get(item.nodeid, 0.0)
    place = {id(item): k for k, item in enumerate(items)}
    items.sort(key=lambda item: (-module_s[item.nodeid.split("::")[0]], place[id(item)]))


class _DurationRecorder:
    """Sums each test's phases as the reports come in (on the xdist controller: every worker's)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    def pytest_sessionfinish(self) -> None:
        """The tests that ran get their new seconds; the others keep theirs (a partial run updates)."""
        known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        merged = {n: s for n, s in known.items() if n not in self.seconds}
        merged.update({n: s for n, s in self.seconds.items() if s >= 1.0})
        slow = sorted(((s, n) for n, s in merged.items()), reverse=True)
        DURATIONS.write_text(json.dumps({n: round(s, 1) for s, n in slow}, indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("store_durations") and not hasattr(config, "workerinput"):  # not on xdist workers
        config.pluginmanager.register(_DurationRecorder(), "fleetbatch-durations")
