"""What a cluster costs: the catalog's default GPU prices and the one rule that turns a cluster's fields into a price.

The defaults are inputs, not claims: about GCP's published on-demand prices in us-central1, in US dollars
per GPU-hour (:data:`DEVICE_PRICES_PER_HOUR`), and spot at :data:`SPOT_FRACTION` of them. A cluster's own
``price_per_hour`` overrides them (it is what the whole cluster costs per hour, in its market: no spot
discount is applied to it). A cluster that sets no price and names a device the table does not price has no
known price (None): it is billed at nothing and the cost policy treats it as free (docs/how-to/spot-and-cost.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Literal

Market = Literal["on-demand", "spot"]
MARKETS: tuple[str, ...] = ("on-demand", "spot")

#: default on-demand prices, US dollars per GPU-hour (about GCP us-central1's list prices)
DEVICE_PRICES_PER_HOUR: MappingProxyType[str, float] = MappingProxyType(
    {"A100-40G": 2.93, "A100": 2.93, "V100-32G": 2.48, "V100": 2.48, "T4": 0.35}
)
#: a spot GPU's default price as a share of its on-demand price
SPOT_FRACTION = 0.3


def market_name(value: object) -> object:
    """``on_demand`` (the spelling of some clouds' APIs) read as ``on-demand``; anything else as it is."""
    return "on-demand" if value == "on_demand" else value


def devices_price_per_hour(devices: Sequence[str], market: Market = "on-demand") -> float | None:
    """The catalog's default price of these devices together, in dollars per hour in ``market``; None when a device
    is not in :data:`DEVICE_PRICES_PER_HOUR` or there is none."""
    if not devices or any(d not in DEVICE_PRICES_PER_HOUR for d in devices):
        return None
    on_demand = sum(DEVICE_PRICES_PER_HOUR[d] for d in devices)
    return on_demand * SPOT_FRACTION if market == "spot" else on_demand


def cluster_price_per_hour(
    price_per_hour: float | None, devices: Sequence[str], market: Market = "on-demand"
) -> float | None:
    """A cluster's price in dollars per hour: its own ``price_per_hour`` when set, else its devices' catalog
    price in its market (:func:`devices_price_per_hour`), else None (not known)."""
    if price_per_hour is not None:
        return float(price_per_hour)
    return devices_price_per_hour(devices, market)
