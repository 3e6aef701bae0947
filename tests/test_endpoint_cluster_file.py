"""The endpoint backend's settings: a cluster file's ``endpoints`` and ``served_model`` checked and turned into
``fleetbatch engine serve`` flags by ``gateway up``, and the flags themselves checked with clear errors."""

from __future__ import annotations

import sys

import pytest

from cliutil.config_file import resolve_config
from clusterfile import ClusterFileError, endpoint_base, parse_cluster_file
from engines.cli import build_parser
from engines.endpoint_settings import API_KEY_ENV, EndpointSettings, api_key
from engines.serve import parse_device_cost, run_serve
from gateway.deploy.supervisor import engine_command


def _cluster(**fields):
    return parse_cluster_file({"version": 1, "clusters": [{"name": "ours", **fields}]}, "f.yaml").clusters[0]


def _refused(**fields) -> str:
    with pytest.raises(ClusterFileError) as e:
        _cluster(**fields)
    return str(e.value)


def test_endpoint_urls_become_openai_base_urls():
    assert endpoint_base("http://gpu-a:8000") == "http://gpu-a:8000/v1"
    assert endpoint_base(" https://h.example/proxy/v1/ ") == "https://h.example/proxy/v1"
    for bad, why in [
        ("gpu-a:8000", "expected http://HOST"),
        ("ftp://h/v1", "expected http://HOST"),
        ("http://:8000", "expected http://HOST"),
        ("http://h:port/v1", "endpoint 'http://h:port/v1'"),
        ("http://h/v1?x=1", "no query"),
    ]:
        with pytest.raises(ValueError, match=why):
            endpoint_base(bad)


def test_the_cluster_file_checks_endpoints_against_the_backend():
    c = _cluster(
        backend="endpoint", endpoints=["http://gpu-a:8000", "http://gpu-b:8000/v1"], served_model="m"
    )
    assert c.endpoints == ["http://gpu-a:8000/v1", "http://gpu-b:8000/v1"] and c.reserved_set() == []
    assert "the endpoint backend needs 'endpoints'" in _refused(backend="endpoint")
    assert "'endpoints' are for 'backend: endpoint', not native" in _refused(endpoints=["http://h:1/v1"])
    assert "leave out 'devices' and 'plan'" in _refused(
        backend="endpoint", endpoints=["http://h:1"], devices=["T4"]
    )
    assert "cluster 'ours': endpoints" in _refused(backend="endpoint", endpoints=["h:1"])


def test_gateway_up_passes_the_endpoints_and_the_model_to_the_engine():
    c = _cluster(
        backend="endpoint", endpoints=["http://gpu-a:8000", "http://gpu-b:8000"], served_model="org/m"
    )
    cmd = engine_command(c, 1, ["--heartbeat-s", "1"])
    assert cmd[:4] == [sys.executable, "-m", "engines.cli", "serve"]
    tail = cmd[cmd.index("--backend") :]
    assert tail[:2] == ["--backend", "endpoint"]
    assert tail[-8:] == [
        "--endpoint-url", "http://gpu-a:8000/v1", "--endpoint-url", "http://gpu-b:8000/v1",
        "--served-model-name", "org/m", "--heartbeat-s", "1",
    ]  # fmt: skip
    native = engine_command(_cluster(served_model="/models/m"), 1, [])
    assert native[native.index("--served-model") + 1] == "/models/m" and "--endpoint-url" not in native
    assert "--served-model" not in engine_command(_cluster(), 1, [])


def _args(*argv: str):
    return resolve_config(build_parser().parse_args(["serve", "--cluster", "c", *argv]), environ={})


def test_the_serve_flags_make_the_settings_and_bad_ones_are_named(tmp_path, monkeypatch):
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    s = EndpointSettings.from_args(
        _args("--backend", "endpoint", "--endpoint-url", "http://h:1", "--endpoint-url", "http://g:2/v1/",
              "--endpoint-key-file", str(key), "--served-model-name", "m", "--max-running", "16",
              "--endpoint-timeout-s", "5")
    )  # fmt: skip
    assert s.urls == ("http://h:1/v1", "http://g:2/v1") and s.api_key == "sk-test" and s.model == "m"
    assert s.timeout_s == 5.0 and s.flow.max_limit == 16 and s.flow.initial_limit == 4.0
    from_env = resolve_config(
        build_parser().parse_args(["serve", "--cluster", "c", "--backend", "endpoint"]),
        environ={"FLEETBATCH_ENDPOINT_URL": "http://a:1 http://b:2", "FLEETBATCH_SERVED_MODEL_NAME": "m"},
    )
    assert from_env.endpoint_url == ["http://a:1", "http://b:2"] and from_env.served_model_name == "m"
    with pytest.raises(ValueError, match="needs --endpoint-url URL"):
        EndpointSettings.from_args(_args("--backend", "endpoint"))
    with pytest.raises(ValueError, match="named twice"):
        EndpointSettings.from_args(_args("--endpoint-url", "http://h:1", "--endpoint-url", "http://h:1/v1"))
    with pytest.raises(ValueError, match="loads no model"):
        EndpointSettings.from_args(_args("--endpoint-url", "http://h:1", "--served-model", "/m"))
    with pytest.raises(ValueError, match="must be > 0"):
        EndpointSettings.from_args(_args("--endpoint-url", "http://h:1", "--endpoint-timeout-s", "0"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        api_key(str(empty))
    with pytest.raises(ValueError, match="cannot read it"):
        api_key(str(tmp_path / "missing"))
    monkeypatch.setenv(API_KEY_ENV, "sk-env")
    assert api_key(None) == "sk-env"
    monkeypatch.delenv(API_KEY_ENV)
    assert api_key(None) is None


def test_device_emulation_does_not_apply_to_the_endpoint_backend(caplog):
    endpoint = ("--backend", "endpoint", "--endpoint-url", "http://h:1", "--redis-url", "redis://127.0.0.1:1")
    with pytest.raises(ValueError, match="not endpoint"):
        parse_device_cost(_args(*endpoint, "--device-cost", "8,0.05,0.5"))
    assert run_serve(_args(*endpoint, "--slowdown", "1")) == 1  # refused before Redis is asked
    assert "--slowdown and --plan do not apply" in caplog.text
