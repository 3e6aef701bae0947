"""The cost policy's rules for moving queued work (:mod:`gateway.assign.cost` has its split and billing model).

**Moves** (:func:`move_allowed`). Under the cost policy the offloader moves queued work to a cluster only when it
is no dearer per token (the batch gets cheaper, or costs the same, and finishes earlier: every move already pays
in finish time), or when the donor would finish past ``MARGIN`` of the time to the nearest deadline (the move
saves it). **How much** a cheaper cluster takes (:func:`fill_rule`): an idle cluster cheaper per token than the
donor takes the donor's queued tail up to what it finishes within its own horizon (the margin of the time to the
nearest deadline, the spot margin for a spot cluster: where the cost split would have put that work), not only
up to equal finish times, which is the token policy's balance and gave a drained queue back to the dear cluster
that took it. **Drains** (:func:`evacuation_rules`): a stopped cluster's queue goes where the cost split puts it.
Pure module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence

from gateway.assign.cost import DEFAULT_WINDOW_S, MARGIN, SPOT_MARGIN, Prices, cost_split, dollars_per_token
from gateway.assign.loads import ClusterView, QueryLoad
from workqueue import keys


def evacuation_rules(
    prices: Prices,
    spot: Collection[str],
    deadline_in_s: float | None = None,
    pending_work_per_token: float = 1.0,
    deadlines_in_s: Mapping[str, float] | None = None,
    spot_margin: float = SPOT_MARGIN,
) -> tuple[Callable[[Sequence[ClusterView], Sequence[QueryLoad]], list[float]], Callable[..., bool]]:
    """Under the cost policy, the rules of a drain (a preempted, dead or removed cluster's queue moved away, by the
    offloader or an admin call; :func:`gateway.offload.rebalance.plan_moves`): where the queue goes (the cost
    split of its queries over the window to the nearest deadline of their own batches, by ``deadlines_in_s``
    (seconds left, by batch id; a batch not in it has none), or, without it, to ``deadline_in_s``, the fleet's
    nearest (None: no deadline), and which balancing moves may follow (:func:`move_allowed`, with the
    fleet's nearest deadline: ``deadline_in_s``, or where only ``deadlines_in_s`` is given, the nearest of those).
    Queued tokens, the drained ones and those the clusters hold alike, are counted at ``pending_work_per_token``
    (the fleet's mix: a queue's entries carry their total tokens, not their prompts), so the split and the rule
    time the same work alike."""
    if deadline_in_s is None and deadlines_in_s is not None:
        deadline_in_s = nearest_deadline(deadlines_in_s)

    def split(views: Sequence[ClusterView], queries: Sequence[QueryLoad]) -> list[float]:
        tokens = math.fsum(q.total_tokens for q in queries)
        window = deadline_in_s
        if deadlines_in_s is not None:  # a queue of loose batches is not spread for another, tight one
            own = [
                deadlines_in_s[b] for b in {keys.split_gid(q.key)[0] for q in queries} if b in deadlines_in_s
            ]
            window = min(own) if own else None
        return cost_split(
            views, prices, tokens, window, pending_work_per_token, spot=spot, spot_margin=spot_margin
        ).targets

    def allowed(donor: ClusterView, recipient: ClusterView) -> bool:
        return move_allowed(donor, recipient, prices, deadline_in_s, work_per_token=pending_work_per_token)

    return split, allowed


def nearest_deadline(deadlines_in_s: Mapping[str, float]) -> float | None:
    """The seconds to the nearest of these batches' deadlines (None: none)."""
    return min(deadlines_in_s.values()) if deadlines_in_s else None


def move_allowed(
    donor: ClusterView,
    recipient: ClusterView,
    prices: Prices,
    deadline_in_s: float | None,
    margin: float = MARGIN,
    work_per_token: float = 1.0,
) -> bool:
    """Whether the offloader may move queued work from ``donor`` to ``recipient`` under the cost policy: the
    recipient is no dearer per token (cheaper, still on time), or the donor would finish past ``margin`` of the
    time to the nearest deadline (``deadline_in_s``; None: no deadline) and the move saves it. ``work_per_token``:
    the work units (:data:`gateway.assign.loads.PROMPT_WEIGHT`) a pending token is worth, at the fleet's prompt
    share (:func:`gateway.assign.loads.work_units`)."""
    if dollars_per_token(recipient, prices) <= dollars_per_token(donor, prices):
        return True
    if deadline_in_s is None or donor.capacity_tps <= 0:
        return False
    return donor.pending_tokens * work_per_token / donor.capacity_tps > margin * max(deadline_in_s, 0.0)


#: the fill stops at this share of the recipient's horizon: between it and the horizon (where :func:`move_allowed`
#: lets a dearer cluster take work back to save the deadline) is room for the estimates to drift (a running query's
#: predicted tokens count until it ends), so that work is not moved there and back
FILL_SHARE = 0.9

#: how far (seconds from now) an idle recipient may fill with a donor's queued work (None: to equal finish times)
FillRule = Callable[[ClusterView, ClusterView], "float | None"]


def fill_rule(
    prices: Prices,
    spot: Collection[str],
    deadline_in_s: float | None = None,
    deadlines_in_s: Mapping[str, float] | None = None,
    spot_margin: float = SPOT_MARGIN,
    margin: float = MARGIN,
    pending_work_per_token: float = 1.0,
) -> FillRule:
    """Under the cost policy, how much of a donor's queued work an idle recipient takes
    (:func:`gateway.offload.moves.plan_offload`): a recipient cheaper per token than the donor takes up to what it
    finishes within :data:`FILL_SHARE` of its horizon, ``margin`` (``spot_margin`` for a cluster named in ``spot``,
    at most ``margin``, as the split counts it) of the time to the
    nearest deadline (``deadline_in_s``, or the nearest of ``deadlines_in_s``; none: :data:`DEFAULT_WINDOW_S`, as
    the split counts a batch without one). Every such token is billed less where it lands and releases the donor
    sooner. Any other pair: None (the balance to equal finish times, where :func:`move_allowed` allows a move).
    The horizon is given as the moves time queued work, tokens over capacity: queued tokens are worth
    ``pending_work_per_token`` work units (the fleet's mix), so a horizon of ``h`` seconds is ``h /
    pending_work_per_token`` there."""
    if deadline_in_s is None and deadlines_in_s is not None:
        deadline_in_s = nearest_deadline(deadlines_in_s)
    left = DEFAULT_WINDOW_S if deadline_in_s is None else max(deadline_in_s, 0.0)

    def until(donor: ClusterView, recipient: ClusterView) -> float | None:
        if dollars_per_token(recipient, prices) >= dollars_per_token(donor, prices):
            return None
        share = min(spot_margin, margin) if recipient.name in spot else margin  # as the split caps it
        return FILL_SHARE * share * left / pending_work_per_token

    return until
