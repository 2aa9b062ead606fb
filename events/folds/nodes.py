"""A node as its events tell it — registered, lost, cordoned, draining — folded once for every reader.

The fleet service (which decides `ctl cordon|uncordon|drain`), the scheduler (which places and
drains) and the ``fleet`` projection (what `ctl nodes` shows) each folded node events their own
way, and they drifted: draining a node cordoned "for a disk swap" made `ctl nodes` say it was
cordoned for "draining" while the scheduler kept the reason a person gave. :func:`fold_node` is
the one fold; readers keep what they need of the result and add what only they track (the
scheduler's last heartbeat).
"""

from __future__ import annotations

import msgspec

from llmgw.events.schema import nodes as N

NODE_EVENTS = (
    N.NodeRegistered,
    N.NodeCapacityChanged,
    N.NodeLost,
    N.NodeReturned,
    N.NodeCordoned,
    N.NodeUncordoned,
    N.NodeDrainRequested,
)
DRAINING_REASON = "draining"  # the cordon reason of a node drained without being cordoned first
DEFAULT_GRACE_S = 300.0


class Node(msgspec.Struct, frozen=True, kw_only=True):
    """``drain_requested_at`` is the first drain request's event time (epoch seconds): the grace counts from it."""

    id: str
    capacity: N.NodeCapacity | None = None
    registered: bool = False
    lost: bool = False
    cordoned: bool = False
    cordon_reason: str = ""
    draining: bool = False
    drain_grace_s: float = DEFAULT_GRACE_S
    drain_requested_at: float | None = None

    @property
    def state(self) -> str:
        """As `ctl nodes` shows it: lost or ready."""
        return "lost" if self.lost else "ready"


def fold_node(node: Node | None, payload: msgspec.Struct, at: float) -> Node:
    """The node after one of its events (``node`` None: none yet). ``at`` is the event's time. Pure.

    Draining cordons the node and keeps the reason it was cordoned for, if it was; a second drain
    request changes the grace but does not restart its clock; uncordoning ends both.
    """
    n = node if node is not None else Node(id=payload.node_id)  # type: ignore[attr-defined]
    replace = msgspec.structs.replace
    match payload:
        case N.NodeRegistered() | N.NodeCapacityChanged():
            return replace(n, capacity=payload.capacity, registered=True)
        case N.NodeLost():
            return replace(n, lost=True)
        case N.NodeReturned():
            return replace(n, lost=False)
        case N.NodeCordoned():
            return replace(n, cordoned=True, cordon_reason=payload.reason)
        case N.NodeUncordoned():
            return replace(n, cordoned=False, draining=False, cordon_reason="", drain_requested_at=None)
        case N.NodeDrainRequested():
            return replace(
                n,
                cordoned=True,
                draining=True,
                drain_grace_s=payload.grace_s,
                drain_requested_at=n.drain_requested_at if n.drain_requested_at is not None else at,
                cordon_reason=n.cordon_reason or DRAINING_REASON,
            )
    return n
