"""``fleetbatch loadgen study --unlike alpaca_eval:<model>``: the token split for a served model unlike the training mix.

The recorded lengths are one ``alpaca_eval`` model's answers (the predictor learned another model's), on the
study's 1:2:4 fleet (token policy, iteration-level engines) with the **offloader off**, so the split made at
submission is what decides when each cluster finishes. Two setups, same workload, fleet and seed:

* ``token_unlike_raw``: a fresh deployment; the whole workload is one batch, split on the predictor's own
  estimates (the calibration learns from the answers as they come, too late for this batch);
* ``token_unlike_calibrated``: the deployment's length calibration is taught ``--calibrate-first`` recorded
  answers of the same model to prompts outside the workload first (:mod:`load.studies.warmup`: a deployment
  that served the model before), so the split is made on calibrated estimates.

The last line gives each setup's ``finish_spread`` (the clusters' finish times' spread over the makespan) and
makespan, side by side.
"""

from __future__ import annotations

from pathlib import Path

from clusterfile import dump_cluster_file
from load.reports.report import build_report
from load.reports.runrecord import write_run
from load.studies.run import run_deployed
from load.studies.warmup import Warmup
from load.workload import from_dataset

SPEEDS = (1.0, 2.0, 4.0)


def add_arguments(p) -> None:
    p.add_argument(
        "--unlike",
        default="",
        metavar="DATASET",
        help="instead of the six setups: the token split for a served model unlike the training mix "
        "(alpaca_eval:<model>), offloader off, without and with a calibration taught first (load/studies/unlike.py)",
    )
    p.add_argument(
        "--calibrate-first",
        type=int,
        default=300,
        metavar="N",
        help="with --unlike: recorded answers taught to the calibrated setup's deployment first (default 300)",
    )
    p.add_argument("--predictor", default="shipped", help="with --unlike: the gateway's length predictor")


def run_unlike(args, fleet_yaml, setup) -> dict:
    """Both setups (the module docstring); ``fleet_yaml`` and ``setup`` are the study's own (no import cycle)."""
    from localmodels import default_tokenizer

    items = from_dataset(args.unlike, args.num_queries, args.seed, args.max_tokens, True, default_tokenizer())
    warmup = Warmup.of(args.unlike, items, args.calibrate_first, args.seed, args.max_tokens, args.predictor)
    root = Path(args.out)
    out: dict = {"dataset": args.unlike, "queries": len(items), "fleet": list(SPEEDS), "offload": False}
    for name, taught in (("token_unlike_raw", None), ("token_unlike_calibrated", warmup)):
        s = setup(name, "token", "native", SPEEDS)
        run_dir = root / name
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_cluster_file(run_dir / "clusters.yaml", fleet_yaml(s, args)["clusters"])
        up = ["--clusters", str(run_dir / "clusters.yaml"), "--policy", "token", "--no-offload"]
        up += ["--predictor", args.predictor, *args.gateway_arg]
        got: list[dict] = []
        before = (
            (lambda info, w=taught, got=got: got.append(w.teach(info["redis_url"], len(SPEEDS))))
            if taught
            else None
        )
        _, batch_ids, rows = run_deployed(run_dir, up, items, name, before=before)
        learned = got[0] if got else None
        meta = {
            "batch_id": batch_ids[0], "policy": "token", "backend": "native", "fleet": list(SPEEDS),
            "emulation": "cost", "offload": False, "device_cost_ms": args.step_cost, "calibration_warmup": learned,
        }  # fmt: skip
        write_run(run_dir, rows, meta)
        report = build_report(run_dir)
        out[name] = {
            "finish_spread": report.get("finish_spread"),
            "makespan_s": report["makespan_s"],
            "finish_by_cluster": report.get("finish_by_cluster"),
            "calibration_warmup": learned,
        }
    raw, cal = out["token_unlike_raw"], out["token_unlike_calibrated"]
    out["finish_spread_raw"], out["finish_spread_calibrated"] = raw["finish_spread"], cal["finish_spread"]
    out["makespan_ratio_calibrated_over_raw"] = round(cal["makespan_s"] / raw["makespan_s"], 3)
    out["out"] = str(root)
    return out
