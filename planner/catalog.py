"""Device catalog: memory, FP16 compute, memory bandwidth and low-bit kernel support per GPU type.

Figures are spec-sheet peaks; ``compute_eff`` / ``mem_eff`` are the fractions a PyTorch decoder
layer reaches in practice and ``layer_overhead_s`` the fixed launch cost of one decoder layer.
The defaults are typical for tensor-core GPUs; P100's are calibrated so that the roofline
profile reproduces the P100/V100 ratios LLM-PQ measured on OPT-13b (14.53x prefill, 7.29x
decode; see ``planner.latency.paper_ratio_check``).

Intra-node links (assumptions, not measured here; used for tensor parallelism and as a node's
default ``intra_node_gbps``): V100-32G and A100/A800/H100 are taken as SXM boards on NVLink,
at roughly the bus bandwidth NCCL's ring all-reduce reaches on them (V100 NVLink2: 300 GB/s
total per GPU, ~130 GB/s all-reduce bus bandwidth; A100 NVLink3: 600 GB/s, ~230 GB/s; A800:
400 GB/s, ~150 GB/s; H100 NVLink4: 900 GB/s, ~360 GB/s) with ~10 us per small all-reduce;
T4 and P100-12G exist only as PCIe cards: PCIe 3.0 x16, 128 Gb/s (the planner's previous
default), ~25 us per all-reduce; L4 / A10: PCIe 4.0 x16, 256 Gb/s.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType

GIB = 1024**3


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator (or the local CPU).

    ``slowdown`` emulates a slower device of this kind on the same hardware: it takes
    ``1 + slowdown`` times as long for every layer and the LM head (the same meaning as
    ``fleetbatch engine serve --slowdown``: extra time as a multiple of the compute time). Such copies come
    from ``with_slowdown``; they carry a distinct ``name`` and keep the catalog name in ``base``
    (read it as ``base_name``).
    """

    name: str
    memory_bytes: int
    fp16_tflops: float
    mem_bw_gbps: float  # GB/s
    int8: bool
    int4: bool
    compute_eff: float = 0.5
    mem_eff: float = 0.75
    layer_overhead_s: float = 60e-6
    is_cpu: bool = False
    # link between devices of this type inside one node (Gb/s, per direction) and the fixed cost of
    # one all-reduce on it; used as a node's default ``intra_node_gbps`` and for tensor parallelism
    intra_node_gbps: float = 128.0  # PCIe 3.0 x16
    allreduce_latency_s: float = 25e-6
    slowdown: float = 0.0
    base: str = ""  # catalog name of an emulated (slowed-down) copy; empty for catalog types
    # a device emulated on this machine (``planner.fleet``): its ``memory_bytes`` is the whole budget a
    # stage may use, with no CUDA context or fragmentation to reserve
    emulated: bool = False

    @property
    def base_name(self) -> str:
        """The catalog name this type derives from (its own name for catalog types)."""
        return self.base or self.name

    @property
    def speed_factor(self) -> float:
        """How many times longer this type takes than its base type: ``1 + slowdown``."""
        return 1.0 + self.slowdown

    def to_dict(self) -> dict:
        return asdict(self)


def _gpu(name: str, mem_gib: float, tflops: float, bw: float, int8: bool, int4: bool, **kw) -> DeviceType:
    return DeviceType(name, int(mem_gib * GIB), tflops, bw, int8, int4, **kw)


CATALOG: MappingProxyType[str, DeviceType] = MappingProxyType(
    {
        d.name: d
        for d in (
            _gpu("T4", 16, 65.0, 320.0, True, True, compute_eff=0.35, mem_eff=0.7),
            _gpu(
                "P100-12G",
                12,
                18.7,
                549.0,
                False,
                False,
                compute_eff=0.2326,
                mem_eff=0.169,
                layer_overhead_s=150e-6,
            ),
            _gpu(
                "V100-32G",
                32,
                125.0,
                900.0,
                True,
                False,
                compute_eff=0.5,
                mem_eff=0.78,
                intra_node_gbps=1040.0,
                allreduce_latency_s=10e-6,
            ),
            _gpu(
                "A100-40G",
                40,
                312.0,
                1555.0,
                True,
                True,
                compute_eff=0.55,
                mem_eff=0.8,
                intra_node_gbps=1840.0,
                allreduce_latency_s=10e-6,
            ),
            _gpu(
                "A800-80G",
                80,
                312.0,
                2039.0,
                True,
                True,
                compute_eff=0.55,
                mem_eff=0.8,
                intra_node_gbps=1200.0,
                allreduce_latency_s=10e-6,
            ),
            _gpu("L4", 24, 121.0, 300.0, True, True, compute_eff=0.45, mem_eff=0.75, intra_node_gbps=256.0),
            _gpu("A10", 24, 125.0, 600.0, True, True, compute_eff=0.45, mem_eff=0.75, intra_node_gbps=256.0),
            _gpu(
                "H100",
                80,
                989.0,
                3350.0,
                True,
                True,
                compute_eff=0.5,
                mem_eff=0.8,
                layer_overhead_s=40e-6,
                intra_node_gbps=2880.0,
                allreduce_latency_s=10e-6,
            ),
        )
    }
)

#: short names accepted in cluster specs
ALIASES: MappingProxyType[str, str] = MappingProxyType(
    {"P100": "P100-12G", "V100": "V100-32G", "A100": "A100-40G", "A800": "A800-80G", "H100-80G": "H100"}
)


def local_cpu(threads: int | None = None) -> DeviceType:
    """The local CPU as a device: memory from ``sysconf``, a rough AVX2 FMA peak and DRAM bandwidth."""
    cores = threads or os.cpu_count() or 1
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 8 * GIB
    # 2 FMA units x 8 fp32 lanes x 2 flops x ~2.5 GHz per core
    tflops = cores * 2 * 8 * 2 * 2.5e9 / 1e12
    return DeviceType(
        "CPU",
        int(mem),
        tflops,
        20.0,
        True,
        True,
        compute_eff=0.5,
        mem_eff=0.5,
        layer_overhead_s=200e-6,
        is_cpu=True,
    )


def device_type(name: str) -> DeviceType:
    """Look a device type up by catalog name or alias (case-insensitive); ``CPU`` is the local CPU."""
    key = name.strip()
    if key.upper() == "CPU":
        return local_cpu()
    upper = {k.upper(): k for k in CATALOG}
    alias = {k.upper(): v for k, v in ALIASES.items()}
    k = key.upper()
    if k in upper:
        return CATALOG[upper[k]]
    if k in alias:
        return CATALOG[alias[k]]
    known = ", ".join(list(CATALOG) + list(ALIASES) + ["CPU"])
    raise ValueError(f"unknown device type {name!r}; known types: {known}")


def with_memory(dev: DeviceType, memory_bytes: int) -> DeviceType:
    """A copy of ``dev`` with another memory size (e.g. a partly reserved GPU)."""
    return replace(dev, memory_bytes=int(memory_bytes))


def with_slowdown(dev: DeviceType, slowdown: float) -> DeviceType:
    """A copy of ``dev`` that runs ``1 + slowdown`` times slower, named e.g. ``CPU@x2`` for slowdown 1.

    ``slowdown`` 0 returns ``dev`` itself; a negative (or non-finite) slowdown is a ``ValueError``.
    Slowdowns compose: slowing an already slowed type multiplies the factors.
    """
    try:
        s = float(slowdown)
    except (TypeError, ValueError):
        s = math.nan
    if isinstance(slowdown, bool) or not math.isfinite(s) or s < 0:
        raise ValueError(f"slowdown must be a finite number >= 0, got {slowdown!r}")
    if s == 0:
        return dev
    total = (1.0 + dev.slowdown) * (1.0 + s) - 1.0
    base = dev.base_name
    return replace(dev, name=f"{base}@x{1 + total:.12g}", slowdown=total, base=base)
