"""The chaos harness's resilient client (load/chaos/client.py) against a real gRPC server on
loopback: it retries a transient error (UNAVAILABLE) and gives up, with the error recorded, on a
permanent one (INVALID_ARGUMENT), where the old client retried forever."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from load.chaos.client import ResilientClient
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc


class Scripted(pb_grpc.BatchServiceServicer):
    """SubmitBatch answers the codes of ``script`` in turn, then OK; the batch is final at once."""

    def __init__(self, script: list[grpc.StatusCode]):
        self.script = list(script)
        self.calls = 0

    def SubmitBatch(self, request, context):
        self.calls += 1
        if self.script:
            context.abort(self.script.pop(0), "scripted failure")
        return pb.Batch(id=request.batch_id)

    def StreamResults(self, request, context):
        return iter(())

    def GetBatch(self, request, context):
        return pb.Batch(id=request.batch_id)


@pytest.fixture
def serve():
    servers = []

    def start(servicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_BatchServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(None)


def run_client(target: str) -> tuple[ResilientClient, threading.Event]:
    stop = threading.Event()
    client = ResilientClient([target], pb.SubmitBatchRequest(batch_id="b1"), stop, token="t")
    thread = client.start()
    thread.join(timeout=30)
    stop.set()  # the old client would still be retrying: stop it, then assert
    thread.join(timeout=10)
    return client, stop


def test_a_transient_error_is_retried(serve):
    servicer = Scripted([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
    client, _ = run_client(serve(servicer))
    assert servicer.calls == 3 and client.final is not None and client.fatal == ""
    assert client.errors == {"UNAVAILABLE": 1, "RESOURCE_EXHAUSTED": 1}


def test_a_permanent_error_ends_the_client_with_the_error_recorded(serve):
    servicer = Scripted([grpc.StatusCode.INVALID_ARGUMENT] * 1000)
    client, _ = run_client(serve(servicer))
    assert servicer.calls == 1, "a permanent error was retried"
    assert client.final is None
    assert "SubmitBatch" in client.fatal and "INVALID_ARGUMENT" in client.fatal, client.fatal
