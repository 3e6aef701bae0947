"""The assignment policies by name (:data:`POLICIES`, :func:`make_policy`): ``--policy`` of the gateway and the
tools. Apart from :mod:`gateway.assign.policies`, so that the prefix policy, which builds on the token policy,
is imported like any other (no import of a module that imports this one back)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from gateway.assign.cost import CostPolicy
from gateway.assign.loads import AssignmentPolicy
from gateway.assign.policies import LeastLoaded, RoundRobin, TokenPolicy
from gateway.assign.prefix_policy import PrefixPolicy

POLICIES: dict[str, Callable[..., AssignmentPolicy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "token": lambda: TokenPolicy(capacity_aware=True),
    "token_equal": lambda: TokenPolicy(capacity_aware=False),
    "prefix": PrefixPolicy,
    "cost": CostPolicy,  # the cheapest split that meets the batch's window (gateway.assign.cost)
}


def make_policy(
    name: str,
    prices: Mapping[str, float] | None = None,
    spot: Collection[str] = (),
    spot_margin: float | None = None,
) -> AssignmentPolicy:
    """A fresh policy by name; ``ValueError`` naming the choices when unknown. ``prices``: each cluster's
    dollars per hour (:func:`gateway.assign.cost.fleet_prices`), and ``spot`` the clusters on spot
    (:func:`gateway.assign.cost.spot_clusters`), for a policy that reads them (``cost``), with ``spot_margin``
    (None: the policy's default, :data:`gateway.assign.cost.SPOT_MARGIN`)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown assignment policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    if not getattr(factory, "priced", False):
        return factory()
    return (
        factory(prices, spot=spot)
        if spot_margin is None
        else factory(prices, spot=spot, spot_margin=spot_margin)
    )
