"""The Grafana dashboard in k8s/ parses, its panels tile without overlap, and every metric its queries read is
one the gateway or an engine worker exports (names taken from their own registries, not a kept list)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from engines.interface import EngineStats
from engines.metrics import WorkerCollector
from gateway.status.metrics import GatewayMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "k8s" / "grafana" / "fleetbatch.json"


def exported(families) -> set[str]:
    """The series names of metric families, as the exposition writes them."""
    names = set()
    for f in families:
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(f.type, ("",))
        names |= {f.name + s for s in suffixes}
    return names


def test_every_query_of_the_dashboard_reads_an_exported_metric():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert dash["uid"] == "fleetbatch" and len(exprs) >= 10
    agent = SimpleNamespace(ticks=0, finished=0, tick_s=0.0, inbox=[], unwritten=lambda: 0)
    worker = SimpleNamespace(
        steps=0,
        busy_s=0.0,
        round_trips=SimpleNamespace(value=0),
        agent=agent,
        engine_stats=EngineStats(),
        resumed_queries=0,
        resumed_tokens=0,
    )
    known = exported(GatewayMetrics().registry.collect()) | exported(WorkerCollector(worker).collect())
    used = {name for e in exprs for name in re.findall(r"\bfleetbatch_[a-z_]+", e)}
    assert used and used <= known, f"not exported: {sorted(used - known)}"
    for needed in (
        "fleetbatch_batch_eta_seconds",
        "fleetbatch_batch_token_progress",
        "fleetbatch_batches_at_risk",
    ):
        assert needed in used


def test_the_panels_tile_without_overlap():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    assert len({p["id"] for p in panels}) == len(panels)
