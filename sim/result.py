"""What one simulation gives: makespan, throughput, KV figures, prefill and prefix-cache hits, per cluster."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SimResult:
    makespan_s: float
    queries: int
    generated_tokens: int
    kv_token_seconds: float
    kv_cached_token_seconds: float
    cumulative_kv_tokens: int
    moved: int
    finish_s: list[float]
    per_cluster: dict[str, dict]
    wall_s: float
    prefill_tokens: int = 0  # prompt tokens the engines computed (cached ones are not computed nor charged)
    prefix_hit_tokens: int = 0  # prompt tokens found in a prefix cache at admission
    prefix_lookup_tokens: int = 0  # prompt tokens looked up at admission
    cost_dollars: float | None = (
        None  # what the fleet cost under the billing model (sim.spot; None: no prices)
    )
    spot: dict | None = None  # sim.spot: queries checkpointed and killed, tokens recomputed

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.generated_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    def summary(self) -> dict:
        return {
            "makespan_s": round(self.makespan_s, 3),
            "throughput_tokens_per_s": round(self.throughput_tokens_per_s, 3),
            "queries_per_s": round(self.queries / self.makespan_s, 4) if self.makespan_s else 0.0,
            "kv_token_seconds": round(self.kv_token_seconds, 1),
            "kv_cached_token_seconds": round(self.kv_cached_token_seconds, 1),
            "cumulative_kv_tokens": self.cumulative_kv_tokens,
            "moved": self.moved,
            "prefill_tokens": self.prefill_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "wall_s": round(self.wall_s, 3),
            **({"cost_dollars": round(self.cost_dollars, 6)} if self.cost_dollars is not None else {}),
            **(self.spot or {}),
        }
