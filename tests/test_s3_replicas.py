"""Two gateway replicas sharing one bucket and one Redis (issue 50, build item 3): one is killed (SIGKILL, by
pid) in the middle of writing a batch's output file into S3, and the other finishes the batch.

Real parts throughout: two ``fleetbatch gateway serve`` processes, the session's Redis, and a real S3 server
process (moto's, :mod:`tests.s3_server`) whose gate holds the second part of every multipart upload, so the
replica that finalizes is caught with its output file half written (part 1 sent, part 2 unanswered), the
point chosen without timing. The lease on the batch names its holder's pid; that process is killed, the gate
opened, and once the dead replica's lease lapses (``FLEETBATCH_FINALIZE_LEASE_S``, 8 s here) the other
writes the files anew: every ``custom_id`` exactly once across the output and error files."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess

import pytest
from openai import OpenAI

from clusterfile import dump_cluster_file
from gateway.http_api.format import COMPLETIONS
from load.chaos.procs import GatewayProcess
from tests.harness import wait_until
from tests.openai_http_helpers import complete_claimed, jsonl, wait_final
from tests.s3_server import S3Server
from workqueue import WorkQueue, connect, keys
from workqueue.embedded import PARENT_ENV

pytestmark = pytest.mark.fault

ROWS = 2500  # each output line ~4.3 KB: an 11 MB output file, two parts (8 MiB and the rest)
TEXT = "lorem ipsum " * 340


def _listening(g: GatewayProcess) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", g.http_port)) == 0


@pytest.fixture(scope="module")
def replicas(redis_server, tmp_path_factory):
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    work = tmp_path_factory.mktemp("replicas")
    s3 = S3Server(work)
    dump_cluster_file(work / "clusters.yaml", [{"name": "idle", "capacity_tps": 100}])
    env = {**s3.env, "FLEETBATCH_FINALIZE_LEASE_S": "8"}
    key, token = secrets.token_urlsafe(12), secrets.token_urlsafe(12)
    gateways = [
        GatewayProcess(
            name,
            redis_server.url,
            work / "clusters.yaml",
            token,
            work,
            client_token=token,
            files_dir=s3.files_url("shared"),
            http_key=key,
            env=env,
        )  # fmt: skip
        for name in ("a", "b")
    ]
    try:
        for g in (
            gateways
        ):  # both at once, from this thread (a child gets SIGTERM when the thread that started it ends)
            g.proc = subprocess.Popen(g.cmd, stdout=g.log_path.open("ab"), stderr=subprocess.STDOUT,
                                      start_new_session=True, env={**g.env, PARENT_ENV: str(os.getpid())})  # fmt: skip
        for g in gateways:
            wait_until(lambda g=g: g.proc.poll() is not None or _listening(g), 180, "a gateway")
            assert g.proc.poll() is None, g.log_path.read_text()[-3000:]
        yield s3, gateways, key, redis_server.url
    finally:
        for g in gateways:
            g.kill()
        s3.close()


def test_a_replica_killed_while_finalizing_leaves_the_batch_to_the_other(replicas):
    s3, (a, b), key, redis_url = replicas
    client_a = OpenAI(base_url=a.http_url, api_key=key, max_retries=2)
    client_b = OpenAI(base_url=b.http_url, api_key=key, max_retries=2)
    rows = [{"custom_id": f"c{i}", "body": {"prompt": f"hello {i}", "max_tokens": 2}} for i in range(ROWS)]
    f = client_a.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    assert client_b.files.retrieve(f.id).bytes == len(jsonl(rows))  # one bucket: b sees a's upload
    batch = client_b.batches.create(input_file_id=f.id, endpoint=COMPLETIONS, completion_window="24h")
    queue = WorkQueue(connect(redis_url))
    s3.hold(2)  # from now on, every multipart upload stops at its second part
    done = 0
    while done < ROWS:  # the engine's side, through the queue API
        done += complete_claimed(queue, "idle", 500, text=TEXT, tokens=2)
    wait_until(lambda: s3.held() >= 1, 60, "a replica to be writing the output's second part")
    holder = queue.r.get(keys.oai_finalize_lease(batch.id))
    pid = int(holder.split(":")[1])
    assert pid in (a.pid, b.pid)
    assert client_a.batches.retrieve(batch.id).status == "finalizing"
    dead, alive = (a, b) if pid == a.pid else (b, a)  # before the kill: a dead replica's pid reads None
    os.kill(pid, signal.SIGKILL)
    dead.proc.wait(timeout=30)
    s3.release()

    client = OpenAI(base_url=alive.http_url, api_key=key, max_retries=2)
    final = wait_final(client, batch.id, 120)
    assert final.status == "completed" and final.request_counts.completed == ROWS
    assert final.output_file_id and final.error_file_id is None
    out = [json.loads(x) for x in client.files.content(final.output_file_id).text.splitlines()]
    ids = [x["custom_id"] for x in out]
    assert len(ids) == len(set(ids)) == ROWS and set(ids) == {r["custom_id"] for r in rows}
    assert all(x["response"]["body"]["choices"][0]["text"] == TEXT for x in out)
    new_holder = queue.r.get(keys.oai_finalize_lease(batch.id))
    assert new_holder is None or int(new_holder.split(":")[1]) == alive.pid
    # the dead replica's upload was never completed: a bucket lifecycle rule clears such uploads
    uploads = s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])
    assert uploads and {u["Key"] for u in uploads} == {f"shared/{final.output_file_id}"}
