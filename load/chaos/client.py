"""A client that outlives gateway and Redis restarts: idempotent submit, resumable stream.

It submits with a fixed ``batch_id`` (a retried submit returns the existing batch) and
streams with ``start_index`` from the next index it has not seen, switching replica on
errors. Results are kept by query id. At the end it re-reads from index 0 whenever it holds
fewer distinct queries than the batch counts as finished: after Redis lost its last second
of writes (AOF ``everysec``) the rewritten results can land at indices it already passed.

Only transient errors are retried (:data:`TRANSIENT`: a replica or Redis down, a limit hit, a
deadline). A permanent error (``INVALID_ARGUMENT``, ``UNAUTHENTICATED``, ``INTERNAL``...) ends
the client: it is kept in :attr:`ResilientClient.fatal` and the chaos books report it. A
``NOT_FOUND`` while streaming means Redis lost the submit (AOF ``everysec``): it submits again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc

from gateway.grpc_api.tls import channel
from load.client import result_row
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc

RETRY_S = 0.5
#: the status codes worth retrying. INTERNAL is not among them: the gateway answers it for a bug,
#: never for a fault it recovers from, so retrying would hide it.
TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
)


class PermanentError(Exception):
    """A call failed with a status code that retrying cannot fix."""


class ResilientClient:
    def __init__(
        self, targets: Sequence[str], request: pb.SubmitBatchRequest, stop: threading.Event, token: str
    ):
        if not request.batch_id:
            raise ValueError("a resilient client needs a batch_id (retried submits must be idempotent)")
        self.targets = list(targets)
        self.request = request
        self.batch_id = request.batch_id
        self.stop = stop
        self.token = token  # the client's Bearer token
        self.results: dict[str, dict] = {}
        self.duplicates_dropped = 0
        self.next_index = 0  # the first result index not yet received
        self.rereads = 0
        self.resubmits = 0  # submits repeated because the batch was gone (idempotent by batch_id)
        self.errors: dict[str, int] = {}
        self.fatal = ""  # the permanent error that ended this client ("" while none)
        self.final: pb.Batch | None = None
        self._turn = 0

    @property
    def target(self) -> str:
        """The replica it talks to now (it moves to the next one after an error)."""
        return self.targets[self._turn % len(self.targets)]

    def _channel(self) -> grpc.Channel:
        return channel(self.target, token=self.token)

    def _failed(self, e: grpc.RpcError, what: str) -> None:
        """Count ``e``; raise :class:`PermanentError` unless it is transient, else wait and switch replica."""
        code = e.code() if hasattr(e, "code") else None
        name = code.name if code is not None else type(e).__name__
        self.errors[name] = self.errors.get(name, 0) + 1
        if code not in TRANSIENT:
            details = e.details() if hasattr(e, "details") else str(e)
            raise PermanentError(f"{what} on {self.target}: {name} {details}")
        self._turn += 1  # try the other replica next
        self.stop.wait(RETRY_S)

    def _call(self, fn, what: str):
        while not self.stop.is_set():
            with self._channel() as ch:
                try:
                    return fn(pb_grpc.BatchServiceStub(ch))
                except grpc.RpcError as e:
                    self._failed(e, what)
        return None

    def _keep(self, r: pb.QueryResult) -> None:
        if r.query_id in self.results:
            self.duplicates_dropped += 1
            return
        self.results[r.query_id] = result_row(r)

    def _stream(self, stub) -> None:
        """Stream from ``next_index`` on; ``next_index`` follows every row, so a broken stream resumes exactly."""
        req = pb.StreamResultsRequest(batch_id=self.batch_id, follow=True, start_index=self.next_index)
        for r in stub.StreamResults(req, timeout=3600):
            self._keep(r)
            self.next_index = r.index + 1

    def run(self) -> None:
        """Submit, then stream until the batch is final (or ``stop``, or a permanent error)."""
        try:
            self._run()
        except PermanentError as e:
            self.fatal = str(e)

    def _run(self) -> None:
        if self._call(lambda s: s.SubmitBatch(self.request, timeout=120), "SubmitBatch") is None:
            return
        while not self.stop.is_set():
            with self._channel() as ch:
                stub = pb_grpc.BatchServiceStub(ch)
                try:
                    self._stream(stub)
                    batch = stub.GetBatch(pb.GetBatchRequest(batch_id=self.batch_id), timeout=30)
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.NOT_FOUND:  # Redis lost the submit (AOF everysec): again
                        self.resubmits += 1
                        self._call(lambda s: s.SubmitBatch(self.request, timeout=120), "SubmitBatch")
                        continue
                    self._failed(e, "StreamResults/GetBatch")
                    continue
            c = batch.request_counts
            if len(self.results) < c.completed + c.failed + c.cancelled:
                self.next_index = 0  # results were rewritten behind us: read them all again
                self.rereads += 1
                continue
            self.final = batch
            return

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name="chaos-client", daemon=True)
        t.start()
        return t
