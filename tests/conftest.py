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
