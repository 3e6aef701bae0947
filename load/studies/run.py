"""One study setup through a real ``fleetbatch gateway up``: deploy, submit, stream every result, sample the engines.

Shared by MICO's study (:mod:`load.studies.study`) and the planners' (:mod:`load.studies.planned`): the
setups differ in their ``fleetbatch gateway up`` arguments and in what their ``meta.json`` records.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gateway.grpc_api.auth import deployment_token
from gateway.grpc_api.tls import channel
from load.arrivals import groups
from load.client import result_row, to_request
from load.deployment import LocalDeployment
from load.reports.runrecord import Sampler
from load.workload import WorkItem
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc


def submit(stub, items: list[WorkItem], name: str, times: list[float] | None, tick_s: float) -> list[str]:
    """Submit ``items`` as one batch (``times`` None), or in arrival groups at their times; the batch ids."""
    if times is None:
        return [stub.SubmitBatch(to_request(items, f"study-{name}"), timeout=600).id]
    t0, ids = time.monotonic(), []
    for k, (at, idx) in enumerate(groups(times, tick_s)):
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        ids.append(stub.SubmitBatch(to_request([items[i] for i in idx], f"study-{name}-{k}"), timeout=600).id)
    return ids


def run_deployed(
    run_dir: Path,
    up_args: list[str],
    items: list[WorkItem],
    name: str,
    times: list[float] | None = None,
    tick_s: float = 0.25,
    before: Callable[[dict], object] | None = None,
) -> tuple[dict, list[str], list[dict]]:
    """``fleetbatch gateway up`` with ``up_args`` under ``run_dir/deploy``, the workload submitted and every result
    streamed back while the engines' heartbeats are sampled into ``run_dir``; ``(gateway.json's info,
    batch ids, result rows)``. ``before(info)`` runs once the deployment is up, before the first submission."""
    with (
        LocalDeployment(run_dir / "deploy", up_args) as info,
        channel(info["address"], token=deployment_token(info)) as ch,
    ):
        stub = pb_grpc.BatchServiceStub(ch)
        if before is not None:
            before(info)
        with Sampler(info["redis_url"], run_dir, interval_s=0.5):
            batch_ids = submit(stub, items, name, times, tick_s)
            rows = [
                result_row(r)
                for batch_id in batch_ids
                for r in stub.StreamResults(
                    pb.StreamResultsRequest(batch_id=batch_id, follow=True), timeout=3600
                )
            ]
            time.sleep(2.5)  # the engines' last heartbeats carry their final KV and device figures
    return info, batch_ids, rows
