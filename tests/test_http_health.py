"""``GET /healthz``, the HTTP front's health route (Kubernetes' readiness probe in k8s/base/gateway.yaml):
200 without a key while Redis answers, 503 while it is down, 200 again once it is back, with no restart;
the rest of the API still needs the key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from tests.openai_http_helpers import http_gateway
from workqueue.embedded import EmbeddedRedis


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_healthz_follows_redis_and_needs_no_key(tmp_path):
    run_dir = tmp_path / "redis"
    server = EmbeddedRedis(run_dir, persist=True)
    g = http_gateway(server.url, tmp_path / "files")
    g.start()
    root = g.config.http_url.removesuffix("/v1")
    try:
        assert _get(root + "/healthz") == (200, {"status": "ok"})
        assert _get(root + "/v1/batches")[0] == 401  # the API itself still needs the key
        server.close()
        status, body = _get(root + "/healthz")
        assert status == 503 and "Redis" in body["error"]["message"], body
        server = EmbeddedRedis(run_dir, persist=True)
        assert _get(root + "/healthz") == (200, {"status": "ok"})
    finally:
        g.stop()
        server.close()
