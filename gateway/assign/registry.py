"""The assignment policies by name (:data:`POLICIES`, :func:`make_policy`): ``--policy`` of the gateway and the
tools. Apart from :mod:`gateway.assign.policies`, so that the prefix policy, which builds on the token policy,
is imported like any other (no import of a module that imports this one back)."""

from __future__ import annotations

from collections.abc import Callable

from gateway.assign.loads import AssignmentPolicy
from gateway.assign.policies import LeastLoaded, RoundRobin, TokenPolicy
from gateway.assign.prefix_policy import PrefixPolicy

POLICIES: dict[str, Callable[[], AssignmentPolicy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "token": lambda: TokenPolicy(capacity_aware=True),
    "token_equal": lambda: TokenPolicy(capacity_aware=False),
    "prefix": PrefixPolicy,
}


def make_policy(name: str) -> AssignmentPolicy:
    """A fresh policy by name; ``ValueError`` naming the choices when unknown."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown assignment policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return factory()
