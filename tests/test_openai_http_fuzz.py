"""Fuzz the OpenAI-compatible HTTP front of a real gateway (HTTP on loopback, real Redis) with hypothesis.

Each case uploads a generated JSONL file (valid lines, invalid JSON and bytes, odd types, huge
and out-of-range numbers, unicode and lone surrogates, missing and unknown fields), creates a
batch from it with a generated body (or a malformed one), and makes one more generated call of
``/v1/files`` or ``/v1/batches`` (get, content, delete, cancel, list, with odd ids and
parameters, sometimes without the key). Never a 5xx; every 4xx in OpenAI's error shape; a batch
whose file is invalid is ``failed`` with nothing enqueued, and a file of valid lines with a
valid body makes a batch that runs. One server serves every case.

600 cases in the normal run; 6,000 with ``FLEETBATCH_NIGHTLY=1``.
"""

from __future__ import annotations

import http.client
import json
import secrets
import socket
import urllib.parse

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import ClusterSpec, GatewayConfig
from gateway.http_api.format import CHAT, COMPLETIONS
from tests.harness import GatewayThread, derandomized, examples
from tests.openai_http_helpers import KEY
from workqueue import WorkQueue, connect

EXAMPLES = examples(150)
CLUSTER = "idle"  # no engine: what is enqueued stays in its queue


@pytest.fixture(scope="module")
def front(redis_server, tmp_path_factory):
    redis.Redis.from_url(redis_server.url).flushall()
    config = GatewayConfig(
        redis_url=redis_server.url,
        offload=False,
        clusters=[ClusterSpec(CLUSTER, capacity_tps=100)],
        http_port=0,
        http_api_key=KEY,
        files_dir=str(tmp_path_factory.mktemp("fuzz-files")),
        chat_template="default",
        max_request_bytes=64 * 1024,
        max_prompt_tokens=64,
        max_queued_per_client=0,
    )
    gateway = GatewayThread(config)
    gateway.start()
    http = Http(config.http_url)
    yield http, WorkQueue(connect(redis_server.url))
    http.conn.close()
    gateway.stop()


class Http:
    """Calls over one kept-alive connection (the stdlib's: nothing to install)."""

    def __init__(self, url: str):
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.base = u.hostname, u.port, u.path
        self.conn = self._connect()

    def _connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms delayed-ACK waits
        return conn

    def call(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict | None = None,
        params: dict | None = None,
    ) -> tuple[int, bytes]:
        query = "&".join(f"{_q(k)}={_q(v)}" for k, v in (params or {}).items())
        target = self.base + path + ("?" + query if query else "")
        sent = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
        try:
            self.conn.request(method, target, body=body, headers=sent)
            r = self.conn.getresponse()
        except (http.client.HTTPException, OSError):  # the server closed the kept-alive connection
            self.conn.close()
            self.conn = self._connect()
            self.conn.request(method, target, body=body, headers=sent)
            r = self.conn.getresponse()
        return r.status, r.read()

    def upload(self, content: bytes, purpose: str) -> tuple[int, bytes]:
        b = secrets.token_hex(16)
        head = f'--{b}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n--{b}\r\n'
        head += 'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
        body = head.encode() + content + f"\r\n--{b}--\r\n".encode()
        return self.call("POST", "/files", body, {"Content-Type": f"multipart/form-data; boundary={b}"})


def _q(text: str) -> str:
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="")


# ---------------------------------------------------------------- strategies

SURROGATE = "\ud800"  # JSON carries it (as \ud800); UTF-8 cannot
HUGE = [2**31, 2**40, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400, 1e300, -1e300, 1e-320]
words = st.text(alphabet="abcdefghij ", min_size=1, max_size=30).filter(str.strip)
texts = st.one_of(st.text(max_size=16), st.sampled_from(["", " ", SURROGATE, "ü✓", "\x00", "a" * 300]))
odd = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from(HUGE),
    st.floats(),  # NaN and infinities too: Python's JSON reads them
    texts,
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | odd, "text": words | odd}),
    max_size=2,
)


def rarely(n: int) -> st.SearchStrategy[bool]:
    """True about once in ``n`` draws (hypothesis favours the first of a sampled list, and 0)."""
    return st.sampled_from([False] * (n - 1) + [True])


@st.composite
def valid_row(draw, i: int) -> dict:
    body: dict = {"model": "m"}
    if draw(st.booleans()):
        body["messages"] = [{"role": "user", "content": draw(words)}]
    else:
        body["prompt"] = draw(words)
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, 16))
    if draw(st.booleans()):
        body["temperature"] = draw(st.floats(0, 2))
    if draw(st.booleans()):
        body["seed"] = draw(st.integers(0, 2**63 - 1))
    return {"custom_id": f"r{i}", "method": "POST", "body": body}


@st.composite
def odd_row(draw, i: int) -> dict:
    row = draw(valid_row(i))
    body = row["body"]
    for _ in range(draw(st.integers(1, 3))):
        key = draw(
            st.sampled_from(
                [
                    "max_tokens",
                    "max_completion_tokens",
                    "temperature",
                    "top_p",
                    "seed",
                    "n",
                    "stop",
                    "stream",
                    "prompt",
                    "messages",
                    "model",
                    "tools",
                    "custom_id",
                    "url",
                    "method",
                    "body",
                ]
            )  # fmt: skip
        )
        if key == "messages":
            value = draw(st.lists(st.fixed_dictionaries({"role": texts | odd, "content": texts | parts | odd}), max_size=2) | odd)  # fmt: skip
        else:
            value = draw(odd | texts)
        if key in ("custom_id", "url", "method", "body"):
            row[key] = value
        else:
            body[key] = value
    for key in draw(st.lists(st.sampled_from(["custom_id", "body", "prompt", "messages"]), max_size=2)):
        row.pop(key, None)
        body.pop(key, None)
    return row


EDGES = [*HUGE, 2**31 - 1, 2**63 - 1, -1, 0, 1, 4097, 1e39, -0.0, 10.5, True]
NUMBERS = ["max_tokens", "max_completion_tokens", "seed", "temperature", "top_p", "n"]


@st.composite
def edge_row(draw, i: int) -> dict:
    """A valid row but for one number at an edge, or one text with a lone surrogate."""
    row = draw(valid_row(i))
    if draw(st.booleans()):
        row["body"][draw(st.sampled_from(NUMBERS))] = draw(st.sampled_from(EDGES))
    else:
        where = draw(st.sampled_from(["custom_id", "prompt", "model", "content"]))
        text = draw(words) + SURROGATE
        if where == "custom_id":
            row["custom_id"] = text
        elif where == "content" or (where == "prompt" and "messages" in row["body"]):
            row["body"]["messages"] = [{"role": "user", "content": text}]
            row["body"].pop("prompt", None)
        else:
            row["body"][where] = text
    return row


def encode(row: dict) -> bytes:
    try:
        return json.dumps(row, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate: as a JSON escape
        return json.dumps(row).encode()


RAW_LINES = [b"[" * 5000 + b"]" * 5000, b"{", b"not json", b"\xff\xfe{}", b"[]", b"null", b'"x"', b"{}",
             b'{"custom_id": "big", "body": {"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}}"]  # fmt: skip


@st.composite
def files(draw) -> tuple[bytes, bool]:
    """A JSONL file, and whether every line is valid."""
    lines, valid = [], True
    for i in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["valid", "valid", "edge", "odd", "raw"]))
        if kind == "valid":
            lines.append(encode(draw(valid_row(i))))
        elif kind == "edge":
            lines.append(encode(draw(edge_row(i))))
            valid = False
        elif kind == "odd":
            lines.append(encode(draw(odd_row(i))))
            valid = False
        else:
            lines.append(draw(st.sampled_from(RAW_LINES) | st.binary(min_size=1, max_size=20)))
            valid = False
    blank = draw(st.sampled_from([b"\n", b"\r\n", b"\n\n"]))
    return blank.join(lines) + draw(st.sampled_from([b"", b"\n"])), valid and bool(lines)


@st.composite
def create_bodies(draw) -> tuple[bytes, bool]:
    """A ``POST /v1/batches`` body, and whether it is well-formed (``FILE`` stands for the
    uploaded file's id: what is drawn depends on nothing outside)."""
    if draw(rarely(12)):
        raw = [b"", b"[]", b"nul", b'"x"', b"{\xff}", b"[" * 5000 + b"]" * 5000]
        return draw(st.sampled_from(raw) | st.binary(max_size=20)), False
    body = {"input_file_id": "FILE", "endpoint": draw(st.sampled_from([CHAT, COMPLETIONS])), "completion_window": "24h"}  # fmt: skip
    ok = True
    if draw(st.booleans()):
        body["metadata"] = draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2))
    if draw(rarely(4)):
        key = draw(st.sampled_from(["input_file_id", "endpoint", "completion_window", "metadata", "extra"]))
        body[key] = draw(odd | texts | st.dictionaries(texts, texts | odd, max_size=2))
        ok = False
    return encode(body), ok


@st.composite
def bad_uploads(draw) -> tuple[bytes, str]:
    """A ``POST /v1/files`` body that is no well-formed upload, and its content type."""
    kind = draw(st.sampled_from(["multipart/form-data; boundary=XX", "multipart/form-data", "application/json",
                                 "text/plain", "multipart/form-data; boundary=" + "b" * 200]))  # fmt: skip
    body = draw(
        st.sampled_from(
            [
                b"",
                b"--XX\r\n",
                b"--XX--\r\n",
                b'--XX\r\nContent-Disposition: form-data; name="file"\r\n\r\nx',
                b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XX--\r\n',
                b'--XX\r\nContent-Disposition: form-data; name="file"; filename="\xff"\r\n\r\n{}\r\n--XX--\r\n',
                b"{}",
            ]
        )  # fmt: skip
        | st.binary(max_size=40)
    )
    if draw(rarely(3)):  # well-formed but for an odd file name
        name = draw(st.sampled_from([b"\xff\xfe", b"..\\..", b"a\x00b", b"\xed\xa0\x80", b"%00", b""]))
        body = (b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--XX\r\n'
                b'Content-Disposition: form-data; name="file"; filename="' + name + b'"\r\n\r\n{}\r\n--XX--\r\n')  # fmt: skip
        kind = "multipart/form-data; boundary=XX"
    return body, kind


def path_id(draw) -> str:
    """An id of this run (``KNOWN-<n>``, filled in later), or an odd one."""
    made = st.integers(0, 19).map(lambda n: f"KNOWN-{n}")
    return _q(draw(made | texts | st.sampled_from(["batch_x", "file-" + "0" * 24, "a:b", ".."])))


@st.composite
def other_calls(draw) -> tuple[str, str, dict]:
    """One more call: (method, path, query parameters)."""
    kind = draw(st.sampled_from(["get", "cancel", "blist", "file", "content", "delete", "flist"]))
    ident = path_id(draw)
    params = {
        k: draw(
            st.sampled_from(
                ["1", "0", "20", "10001", "-1", "x", "asc", "desc", "batch", "", "²", "٣", "9" * 5000]
            )
            | texts
        )
        for k in draw(st.lists(st.sampled_from(["limit", "after", "order", "purpose"]), max_size=3))
    }
    return {
        "get": ("GET", f"/batches/{ident}", params),
        "cancel": ("POST", f"/batches/{ident}/cancel", {}),
        "blist": ("GET", "/batches", params),
        "file": ("GET", f"/files/{ident}", {}),
        "content": ("GET", f"/files/{ident}/content", {}),
        "delete": ("DELETE", f"/files/{ident}", {}),
        "flist": ("GET", "/files", params),
    }[kind]


# ---------------------------------------------------------------- the test


def _checked(answer: tuple[int, bytes], counts: dict[str, int], what: str) -> dict:
    status, raw = answer
    assert status < 500, (what, status, raw[:500])
    body = (
        json.loads(raw) if status >= 400 or (status == 200 and what != "content") else {}
    )  # 3xx: a redirect
    if status >= 400:
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (what, error)
    counts[f"{what} {status}"] = counts.get(f"{what} {status}", 0) + 1
    return {"status": status, **({"body": body} if isinstance(body, dict) else {})}


def test_generated_files_and_bodies_never_get_a_5xx_and_rejected_files_enqueue_nothing(front):
    api, queue = front
    counts: dict[str, int] = {}
    known: list[str] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=derandomized(),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def one_case(data):
        content, lines_ok = data.draw(files())
        purpose = data.draw(st.sampled_from(["batch"] * 8 + ["fine-tune", ""]))
        if data.draw(rarely(10)):  # a malformed upload body
            raw, kind = data.draw(bad_uploads())
            _checked(api.call("POST", "/files", raw, {"Content-Type": kind}), counts, "upload")
        up = _checked(api.upload(content, purpose), counts, "upload")
        file_id = up["body"]["id"] if up["status"] == 200 else None
        body, body_ok = data.draw(create_bodies())
        if file_id is None:
            body_ok = False
        body = body.replace(b'"FILE"', json.dumps(file_id).encode())
        queued = len(queue.queued_ids(CLUSTER))
        made = _checked(api.call("POST", "/batches", body), counts, "create")
        if made["status"] == 200:
            batch = made["body"]
            known.append(batch["id"])
            kind = "batch failed" if batch["status"] == "failed" else "batch runs"
            counts[kind] = counts.get(kind, 0) + 1
            if batch["status"] == "failed":
                assert batch["errors"]["data"] and batch["request_counts"]["total"] == 0, batch
                assert queue.batch(batch["id"]) is None and len(queue.queued_ids(CLUSTER)) == queued
            else:
                assert batch["status"] in ("validating", "in_progress"), batch
                assert queue.batch(batch["id"]) is not None
            assert not (lines_ok and body_ok) or batch["status"] != "failed", (content, batch)
        else:
            assert len(queue.queued_ids(CLUSTER)) == queued
            assert not (lines_ok and body_ok and purpose == "batch"), (content, made)
        if file_id:
            known.append(file_id)
        method, path, params = data.draw(other_calls())
        if "KNOWN-" in path:
            n = int(path.split("KNOWN-")[1].split("/")[0])
            path = path.replace(f"KNOWN-{n}", known[-1 - n % len(known)] if known else "batch_x", 1)
        auth = {"Authorization": "Bearer wrong"} if data.draw(rarely(20)) else {}
        what = "content" if path.endswith("/content") else f"{method} {path.split('/')[1]}"
        _checked(api.call(method, path, headers=auth, params=params), counts, what)

    one_case()
    assert sum(v for k, v in counts.items() if k.startswith("create")) >= EXAMPLES, counts
    codes = {int(k.rsplit(" ", 1)[1]) for k in counts if k.rsplit(" ", 1)[1].isdigit()}
    assert {200, 400, 401, 404} <= codes, counts
    assert {"batch failed", "batch runs"} <= set(counts), counts  # both roads taken
    assert api.call("GET", "/batches", params={"limit": "1"})[0] == 200  # still serving
