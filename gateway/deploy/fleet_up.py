"""``fleetbatch gateway up --clusters``: plan a fleet of catalog devices and start engines that run the plans.

At start-up, for a cluster file whose clusters name devices (``--clusters FILE``, or the default fleet: fast = 2 x A100-40G,
medium = V100-32G + T4, slow = 2 x T4):

1. this CPU's profile of the served model (``fleetbatch engine profile``), cached per machine in the
   fleetbatch cache directory (``$FLEETBATCH_CACHE/profiles``), measured once;
2. ``fleetbatch planner fleet``: every cluster planned on its devices as emulated here (cached in
   ``<run-dir>/plans`` by the content of the fleet, model, profile and workload; the solve time
   is logged);
3. one ``fleetbatch engine serve --plan P --device-cost plan`` per cluster: stage processes, the plan's
   per-layer bits and micro-batch sizes, each stage lasting what its device takes; the cluster's
   capacity hint is the plan's predicted tokens/s (the gateway corrects it by measurement).

The gateway does not import the planner (docs/design/layers.md): it runs the two commands and reads
their JSON. ``--fleet-method`` picks the plan each cluster runs: ``ilp`` (the planner), a
baseline (``uniform``: even split, one bit width that fits; ``het``), or ``best-baseline`` (per
cluster the baseline the planner's model rates faster).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from gateway.config import ClusterSpec
from localmodels.paths import cache_dir

log = logging.getLogger(__name__)

BASELINES = ("uniform", "het")
FLEET_METHODS = ("ilp", *BASELINES, "best-baseline")
KV_TOKENS = 16384


@dataclass(frozen=True)
class FleetSettings:
    """What ``fleetbatch gateway up`` plans: the fleet file, the served random model, the plan each cluster runs."""

    fleet: str = "default"
    arch: str = "llama"
    size: str = "micro"
    method: str = "ilp"
    kv_tokens: int = KV_TOKENS
    time_limit_s: float = 6.0
    prompt_len: int = 128  # the planned workload's mean prompt and response tokens
    output_tokens: int = 128

    @classmethod
    def from_args(cls, args) -> FleetSettings:
        """From ``fleetbatch gateway up``'s ``--clusters``, ``--fleet-method``, ``--fleet-lengths`` and ``--size``."""
        try:
            prompt, output = (int(x) for x in args.fleet_lengths.split(","))
        except ValueError:
            raise ValueError(
                f"--fleet-lengths is PROMPT,OUTPUT tokens (e.g. 128,128), not {args.fleet_lengths!r}"
            ) from None
        if prompt < 1 or output < 1:
            raise ValueError(f"--fleet-lengths must be >= 1 tokens each, not {args.fleet_lengths!r}")
        return cls(
            args.clusters,
            size=args.size or "micro",
            method=args.fleet_method,
            prompt_len=prompt,
            output_tokens=output,
        )


def _run(cmd: list[str], what: str, log_file: Path) -> str:
    """Run ``cmd`` (its stderr to ``log_file``); its stdout, or a RuntimeError naming ``what`` failed."""
    with open(log_file, "ab") as err:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, check=False)
    if out.returncode != 0:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{what} failed (exit {out.returncode}): {' / '.join(tail)} (log: {log_file})")
    return out.stdout


def cpu_profile(s: FleetSettings, log_dir: Path) -> Path:
    """This CPU's profile of the served model, measured once per machine, model and torch version."""
    path = cache_dir() / "profiles" / f"{s.arch}-{s.size}-torch{version('torch')}.json"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("profiling this CPU on the served model %s:%s (once; cached in %s)", s.arch, s.size, path)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cmd = [sys.executable, "-m", "engines.cli", "profile", "--arch", s.arch, "--size", s.size, "--reps", "2",
           "--min-time", "0.02", "--out", str(tmp)]  # fmt: skip
    _run(cmd, "fleetbatch engine profile", log_dir / "profile.log")
    tmp.replace(path)
    return path


def plan_fleet(s: FleetSettings, run_dir: Path) -> dict:
    """``fleetbatch planner fleet``'s summary for ``s`` (plans under ``<run_dir>/plans``)."""
    log_dir = run_dir / "logs"
    profile = cpu_profile(s, log_dir)
    methods = "ilp," + ",".join(BASELINES) if s.method != "ilp" else "ilp"
    cmd = [sys.executable, "-m", "planner.cli", "-v", "fleet", s.fleet, "--shape", f"{s.arch}:{s.size}",
           "--profile", str(profile), "--methods", methods, "--out", str(run_dir / "plans"),
           "--kv-budget-tokens", str(s.kv_tokens), "--time-limit", str(s.time_limit_s),
           "--prompt-len", str(s.prompt_len), "--output-tokens", str(s.output_tokens)]  # fmt: skip
    log_file = log_dir / "planner.log"
    start = log_file.stat().st_size if log_file.exists() else 0
    out = _run(cmd, f"fleetbatch planner fleet {s.fleet}", log_file)
    with open(log_file, errors="replace") as f:  # this run's lines: each cluster's solve, or the cache hit
        f.seek(start)
        for line in f.read().splitlines():
            if "planner.fleet_plans" in line:
                log.info("%s", line.split("planner.fleet_plans: ", 1)[-1])
    return json.loads(out.strip().splitlines()[-1])


def chosen(rows: dict[str, dict], method: str) -> dict:
    """The plan row a cluster runs under ``method`` (``best-baseline``: the faster baseline, modelled)."""
    if method == "best-baseline":
        return max((rows[m] for m in BASELINES), key=lambda r: r["predicted_tokens_per_s"])
    return rows[method]


def fleet_specs(s: FleetSettings, summary: dict) -> tuple[list[ClusterSpec], dict[str, dict]]:
    """One cluster spec per planned cluster, and the layout each runs (``summary``'s row)."""
    specs, layouts = [], {}
    for name, rows in summary["clusters"].items():
        row = chosen(rows, s.method)
        layouts[name] = row
        specs.append(
            ClusterSpec(
                name=name,
                capacity_tps=float(row["predicted_tokens_per_s"]),
                plan=row["plan"],
                backend="native",
                kv_budget_tokens=s.kv_tokens,
                engine_args=[
                    "--arch",
                    s.arch,
                    "--size",
                    s.size,
                    "--device-cost",
                    "plan",
                    "--kv-budget-tokens",
                    str(s.kv_tokens),
                ],  # fmt: skip
            )
        )
    return specs, layouts


def bits_histogram(row: dict) -> str:
    """``4-bit x6, 8-bit x2``: how many layers run at each bit width."""
    counts = Counter(b for stage in row["bits"] for b in stage)
    return ", ".join(f"{b}-bit x{n}" for b, n in sorted(counts.items()))


def idle_devices(row: dict, fleet_devices: list[str] | None = None) -> list[str]:
    """The cluster's devices (``fleet_devices``, else the row's own ``fleet_devices``) its plan leaves unused."""
    devices = fleet_devices if fleet_devices is not None else row.get("fleet_devices") or row["devices"]
    return list((Counter(devices) - Counter(row["devices"])).elements())


def describe_layout(name: str, row: dict, fleet_devices: list[str] | None = None) -> str:
    """One line per cluster: devices, stages with their layers, bits, predicted tokens/s."""
    stages = "; ".join(
        f"{dev} layers {lo}-{hi - 1}" for dev, (lo, hi) in zip(row["devices"], row["layers"], strict=True)
    )
    idle = idle_devices(row, fleet_devices)
    unused = f" ({', '.join(idle)} left idle)" if idle else ""
    return (
        f"{name}: {len(row['devices'])} stage(s): {stages}{unused}; bits {bits_histogram(row)}; "
        f"micro-batches prefill {row['prefill_micro_batch']} / decode {row['decode_micro_batch']}; "
        f"{row['method']} plan predicts {row['predicted_tokens_per_s']:.0f} tokens/s"
    )
