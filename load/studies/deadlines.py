"""``fleetbatch loadgen deadlines``: batches with different completion windows on one fleet, earliest deadline first
against first in, first out, the ETA's error as the batches run, and an expired batch's rows.

The scenario (same fleet, workload and submission times in every run): the ``--num-queries`` queries of the
mixed workload (recorded lengths) are split into three batches, submitted over gRPC a few seconds
apart, each with a completion window that is a multiple of ``T``, the whole workload's makespan on
the fleet as the simulator predicts it from the recorded lengths:

* ``bulk`` (60 % of the rows) at 0 s, window 1.6 T: any order meets it;
* ``urgent`` (25 %) at +2 s, window 0.65 T: met only if it overtakes ``bulk``;
* ``steady`` (15 %) at +4 s, window 1.2 T.

Each order (``--orders``, default ``edf,fifo``: ``fleetbatch gateway up --queue-order``) runs in its own
``fleetbatch gateway up`` on the cost-model devices of ``fleetbatch loadgen study`` (the 1:2:4 fleet, token policy,
offloading on), with the learned predictor. While it runs, every batch is read with ``GetBatch``
every half second: its token progress (predicted tokens done of its predicted tokens) and its
predicted finish (``predicted_finish_at``), kept in ``etas.jsonl``. Then ``expiry``: once the edf
run's batches are final, a batch goes through the same deployment's OpenAI-compatible HTTP front
(a deployment of its own when edf is not run) whose window (0.2 T) ends while it runs, and its
output and error files are checked.

The last line is one JSON object: ``deadlines_met_edf`` and ``deadlines_met_fifo`` (batches that
finished within their window), ``missed_by_edf_met_by_fifo`` (should be empty), ``met_by_edf_missed_by_fifo``,
``eta_error_at_25pct`` and ``eta_error_at_50pct`` (the median, over the runs' batches, of
|predicted - actual finish| / (actual finish - submission), the prediction read when 25 % (50 %)
of the batch's predicted tokens were done), ``expired_rows_correct`` (every row of the expired batch
exactly once, in the output or the error file, the unfinished ones as ``batch_expired``), and the
simulator's replay of each run: ``sim_deadlines_met_edf``/``_fifo`` and ``sim_finish_error`` (the mean
|simulated - actual| / actual finish of the batches, from submission). See docs/design/deadlines.md.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from clusterfile import dump_cluster_file
from gateway.grpc_api.auth import deployment_token
from gateway.grpc_api.tls import channel
from load.client import result_row, to_request
from load.deployment import LocalDeployment
from load.reports.runrecord import Sampler, write_run
from load.studies.deadlines_stats import Plan, expired_rows_problems, scenario_plan, summarise
from load.studies.study import Setup, add_fleet_arguments, fleet_yaml, workload
from load.studies.warmup import Warmup
from load.workload import WorkItem
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from workqueue.ordering import QueueOrder

POLL_S = 0.5
SPEEDS = (1.0, 2.0, 4.0)
T = TypeVar("T")
Expiry = tuple[list[str], dict]  # what is wrong with the expired batch's files; its rows finished and expired


def add_arguments(p) -> None:
    p.add_argument(
        "--num-queries", "-n", type=int, default=480, help="queries in all, split over the three batches"
    )
    p.add_argument(
        "--dataset", default="mixed", help="real workload with recorded lengths ('' for the generated mix)"
    )
    p.add_argument("--max-tokens", type=int, default=256, help="cap on the recorded response lengths")
    p.add_argument("--orders", default="edf,fifo", help="queue orders to compare, one run each")
    p.add_argument("--no-expiry", action="store_true", help="skip the expired-batch run")
    p.add_argument("--predictor", default="shipped", help="the gateway's length predictor")
    p.add_argument(
        "--calibrate-first",
        type=int,
        default=0,
        metavar="N",
        help="teach each deployment's length calibration N recorded answers of the dataset's model to prompts "
        "outside the workload before the first batch (a deployment that served the model before; "
        "load/studies/warmup.py); 0: a fresh deployment, calibrated only by what the run observes",
    )
    add_fleet_arguments(p, "runs/deadlines", "one run directory per order, and the expiry run")
    p.set_defaults(emulation="cost", policy="token")  # what load.studies.study.fleet_yaml reads


def _up_args(run_dir: Path, args, order: str) -> list[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_cluster_file(
        run_dir / "clusters.yaml", fleet_yaml(Setup("deadlines", "token", "native", SPEEDS), args)["clusters"]
    )
    return [
        "--clusters", str(run_dir / "clusters.yaml"), "--policy", "token", "--predictor", args.predictor,
        "--queue-order", order, *args.gateway_arg,
    ]  # fmt: skip


def _window(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def _submit_all(stub, plan: Plan, items: list[WorkItem], t0: float, ids: dict[str, str]) -> None:
    for b in plan.batches:
        time.sleep(max(0.0, t0 + b.at_s - time.monotonic()))
        req = to_request([items[i] for i in b.rows], f"deadlines-{b.name}")
        req.completion_window = _window(b.window_s)
        ids[b.name] = stub.SubmitBatch(req, timeout=600).id


def _poll(stub, ids: dict[str, str], n: int, etas: list[dict], limit_s: float) -> dict[str, pb.Batch]:
    """Read every batch until all ``n`` are submitted and final (TimeoutError after ``limit_s``); each read is
    kept in ``etas``."""
    final: dict[str, pb.Batch] = {}
    give_up = time.monotonic() + limit_s
    while len(final) < n:
        if time.monotonic() > give_up:
            raise TimeoutError(f"batches {sorted(set(ids) - set(final))} not final after {limit_s:.0f} s")
        for name, bid in list(ids.items()):
            if name in final:
                continue
            b = stub.GetBatch(pb.GetBatchRequest(batch_id=bid), timeout=30)
            etas.append(
                {
                    "batch": name, "t": time.time(), "status": pb.BatchStatus.Name(b.status),
                    "predicted_tokens": b.predicted_tokens, "done_predicted_tokens": b.done_predicted_tokens,
                    "predicted_finish_at": b.predicted_finish_at, "at_risk": b.at_risk,
                    "created_at": b.created_at, "deadline": b.deadline, "completed_at": b.completed_at,
                }
            )  # fmt: skip
            if b.completed_at > 0:
                final[name] = b
        time.sleep(POLL_S)
    return final


def run_order(
    order: str,
    items: list[WorkItem],
    plan: Plan,
    out: Path,
    args,
    after: Callable[[dict], T] | None = None,
    warmup: Warmup | None = None,
) -> tuple[dict, T | None]:
    """One ``fleetbatch gateway up`` with this queue order: the batches submitted on the plan, read until final; then
    ``after(info)`` on the same deployment, outside the run's record (what it returns comes back too)."""
    run_dir = out / order
    up = _up_args(run_dir, args, order)
    etas: list[dict] = []
    with LocalDeployment(run_dir / "deploy", up) as info:
        taught = warmup.teach(info["redis_url"], len(SPEEDS)) if warmup is not None else None
        with (
            channel(info["address"], token=deployment_token(info)) as ch,
            Sampler(info["redis_url"], run_dir, interval_s=0.5),
        ):
            stub = pb_grpc.BatchServiceStub(ch)
            ids: dict[str, str] = {}
            submitter = threading.Thread(
                target=_submit_all, args=(stub, plan, items, time.monotonic(), ids), daemon=True
            )
            submitter.start()
            final = _poll(stub, ids, len(plan.batches), etas, 10 * plan.makespan_s + 600)
            submitter.join()
            rows = [
                result_row(r)
                for bid in ids.values()
                for r in stub.StreamResults(pb.StreamResultsRequest(batch_id=bid), timeout=600)
            ]
        then = after(info) if after is not None else None
    (run_dir / "etas.jsonl").write_text("".join(json.dumps(e) + "\n" for e in etas))
    meta = {
        "order": order, "policy": "token", "backend": "native", "fleet": list(SPEEDS), "offload": True,
        "emulation": "cost", "device_cost_ms": args.step_cost, "batch_ids": ids, "calibration_warmup": taught,
        "batches": {
            b.name: {"submitted_at": final[b.name].created_at, "window_s": b.window_s,
                     "deadline": final[b.name].deadline,
                     "order_key": QueueOrder(order).key(final[b.name].created_at, final[b.name].deadline,
                                                        final[b.name].priority),
                     "completed_at": final[b.name].completed_at, "status": pb.BatchStatus.Name(final[b.name].status)}
            for b in plan.batches
        },
    }  # fmt: skip
    write_run(run_dir, rows, meta)
    return meta, then


def run_expiry(items: list[WorkItem], plan: Plan, out: Path, args, info: dict | None = None) -> Expiry:
    """A batch whose window ends while it runs, through the OpenAI front of the deployment ``info`` (an edf
    one of its own when None): what is wrong with its files, and how many of its rows finished and expired."""
    if info is None:
        with LocalDeployment(out / "expiry" / "deploy", _up_args(out / "expiry", args, "edf")) as own:
            return run_expiry(items, plan, out, args, own)
    from openai import OpenAI

    from load.soaks.openai_check import input_rows

    for name in ("httpx", "httpx2"):  # the client logs every poll at INFO
        logging.getLogger(name).setLevel(logging.WARNING)

    rows = input_rows([items[i] for i in plan.expiry_rows], "/v1/chat/completions")
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    key = Path(info["http_api_key_file"]).read_text().strip()
    client = OpenAI(base_url=info["http_url"], api_key=key, max_retries=2)
    f = client.files.create(file=("input.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window=_window(plan.expiry_window_s),
    )
    limit = time.monotonic() + plan.expiry_window_s + 600
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        if time.monotonic() > limit:
            return [f"batch {batch.id} still {batch.status} long after its window"], {}
        time.sleep(POLL_S)
        batch = client.batches.retrieve(batch.id)

    def lines(file_id: str | None) -> list[dict]:
        return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []

    output, errors = lines(batch.output_file_id), lines(batch.error_file_id)
    (out / "expiry").mkdir(parents=True, exist_ok=True)
    (out / "expiry" / "files.json").write_text(
        json.dumps({"batch": batch.model_dump(), "output": len(output), "errors": errors[:20]}, default=str)
    )
    problems = expired_rows_problems(batch, [r["custom_id"] for r in rows], output, errors)
    return problems, {"rows": len(rows), "finished": len(output), "expired": len(errors)}


def run(args) -> dict:
    if args.num_queries < 6:
        raise ValueError("--num-queries must be >= 6 (three batches)")
    orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    bad = [o for o in orders if o not in ("edf", "fifo")]
    if bad or not orders:
        raise ValueError(f"--orders: edf and/or fifo, not {args.orders!r}")
    out = Path(args.out)
    items = workload(args)
    plan = scenario_plan(items, SPEEDS, args, out)
    warmup = None
    if args.calibrate_first > 0:
        if not args.dataset:
            raise ValueError("--calibrate-first needs --dataset: the recorded answers of its model")
        warmup = Warmup.of(
            args.dataset, items, args.calibrate_first, args.seed, args.max_tokens, args.predictor
        )
    print(f"the simulator's makespan of the whole workload: T = {plan.makespan_s:.1f} s; windows "
          + ", ".join(f"{b.name} {b.window_s:.0f} s at +{b.at_s:.0f} s" for b in plan.batches))  # fmt: skip
    # the expiry batch runs on the edf run's deployment once its batches are final (one start-up fewer)
    host = None if args.no_expiry or "edf" not in orders else "edf"
    metas: dict[str, dict] = {}
    expiry: Expiry | None = None
    for order in orders:
        after = (lambda info: run_expiry(items, plan, out, args, info)) if order == host else None
        metas[order], got = run_order(order, items, plan, out, args, after, warmup)
        expiry = got or expiry
        print(f"{order}: " + ", ".join(f"{n} {m['status']}" for n, m in metas[order]["batches"].items()))
    if not args.no_expiry and host is None:
        expiry = run_expiry(items, plan, out, args)
    problems, rows = expiry if expiry is not None else (None, None)
    result = summarise(out, orders, plan, args, problems)
    if rows is not None:
        result["expiry_rows"] = rows
    result["calibration_warmup"] = metas[orders[0]]["calibration_warmup"]
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    return result
