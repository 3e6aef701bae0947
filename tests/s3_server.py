"""A real S3-compatible server for the tests: moto's standalone server in a process of its own, on loopback.

:class:`S3Server` starts ``python -m tests.s3_server --port-file F`` (moto's WSGI app, threaded, as
``moto_server`` serves it; it binds a free port and writes it to a file), waits for it, and gives the environment a client needs
(``AWS_ENDPOINT_URL``, a region, test credentials): the gateway reads them as any AWS SDK user
would. The server has one addition, a gate (``/_gate``): ``hold(n)`` makes it hold every multipart
``UploadPart`` numbered ``n`` or more (the request waits, unanswered) until ``release()``, and
``held()`` says how many it holds: a test stops a gateway in the middle of writing a file, at a
point it chooses, without timing. ``cut_next_read(n)`` breaks the connection of the next whole-object
GET after ``n`` bytes of its body (a read cut short mid-stream).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs

REPO = Path(__file__).resolve().parent.parent
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """One moto server process; ``bucket`` made at start."""

    def __init__(self, log_dir: Path, bucket: str = "fleetbatch-test") -> None:
        self.bucket = bucket
        port_file = log_dir / f"s3-server-{secrets.token_hex(4)}.port"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        with open(log_dir / "s3-server.log", "ab") as log:  # the server binds a free port itself: no race
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.s3_server", "--port-file", str(port_file)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the S3 server did not start; see {log_dir / 's3-server.log'}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.url}
        self.client().create_bucket(Bucket=bucket)

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=CREDENTIALS["AWS_REGION"],
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def files_url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def _gate(self, query: str) -> dict:
        with urllib.request.urlopen(f"{self.url}/_gate?{query}", timeout=10) as r:
            return json.loads(r.read())

    def hold(self, part: int) -> None:
        """Hold every UploadPart numbered ``part`` or more until :meth:`release`."""
        self._gate(f"hold_from_part={part}")

    def held(self) -> int:
        return int(self._gate("")["held"])

    def cut_next_read(self, after: int) -> None:
        """Break the connection of the next whole-object GET after ``after`` bytes of its body."""
        self._gate(f"cut_after={after}")

    def cuts(self) -> int:
        return int(self._gate("")["cuts"])

    def release(self) -> None:
        self._gate("release=1")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Gate:
    """WSGI middleware in front of moto's app: holds UploadPart calls from a part number on (``/_gate``)."""

    def __init__(self, app) -> None:
        self.app, self.hold_from, self.held = app, 0, 0
        self.cut_after, self.cuts = 0, 0
        self.open = threading.Event()
        self.open.set()

    def __call__(self, environ, start_response):
        query = parse_qs(environ.get("QUERY_STRING", ""))
        if environ.get("PATH_INFO") == "/_gate":
            if "hold_from_part" in query:
                self.hold_from = int(query["hold_from_part"][0])
                self.open.clear()
            if "release" in query:
                self.hold_from = 0
                self.open.set()
            if "cut_after" in query:
                self.cut_after = int(query["cut_after"][0])
            body = json.dumps({"held": self.held, "cuts": self.cuts}).encode()
            start_response(
                "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            )
            return [body]
        part = query.get("partNumber")
        if (
            self.hold_from
            and environ.get("REQUEST_METHOD") == "PUT"
            and part
            and int(part[0]) >= self.hold_from
        ):
            self.held += 1
            self.open.wait(300)
        if self.cut_after and environ.get("REQUEST_METHOD") == "GET" and "HTTP_RANGE" not in environ:
            after, self.cut_after = self.cut_after, 0
            return self._cut(self.app(environ, start_response), after)
        return self.app(environ, start_response)

    def _cut(self, body, after: int):
        """The response's first ``after`` bytes, then the connection broken (its Content-Length unmet)."""
        sent = 0
        for piece in body:
            if sent + len(piece) >= after:
                yield piece[: after - sent]
                self.cuts += 1
                raise ConnectionAbortedError("the gate cut this response")
            sent += len(piece)
            yield piece


def main() -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=0, help="the port (0: a free one)")
    p.add_argument("--port-file", default=None, help="write the port here once listening")
    args = p.parse_args()
    app = Gate(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", args.port, app, threaded=True, request_handler=MotoRequestHandler)
    os.environ["MOTO_PORT"] = str(server.server_port)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(server.server_port))
        tmp.replace(args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
