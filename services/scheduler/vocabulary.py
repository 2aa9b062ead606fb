"""The scheduler's vocabulary: its settings, its clock, and the decisions a pass returns.

Every other scheduler module speaks these words, so this one imports none of them but the few it is
made of: placement's ``Need``/``Verdict`` (what a placement reserves, why a node does not fit),
preemption's defaults, and the state ``event_of`` reads:

- :class:`Config`, the settings (`llmgw.toml`'s ``scheduler:``), and :class:`Clock`, the times a pass is
  judged at (a pass reads no clock of its own, so tests and `ctl explain` can ask at any time);
- the decisions (:data:`Decision`): what ``reconcile.reconcile`` returns, in the order the shell
  appends them;
- :func:`event_of`: the event the shell appends for a decision (pure, so tests fold exactly what the
  service would write).
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.services.scheduler import preemption as PRE
from llmgw.services.scheduler.placement import Need, Verdict
from llmgw.services.scheduler.state import ClusterState, ModelState

# -- settings and time ----------------------------------------------------------------------------


class Config(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler's settings (`llmgw.toml`'s ``scheduler:`` section); every default is SPEC's."""

    lost_after_s: float = 30.0
    park_after: int = 5
    backoff_base_s: float = 2.0
    backoff_cap_s: float = 300.0
    stop_grace_s: float = 30.0
    idle_s: float = 300.0  # an on-demand model's replica stops after this long without a request
    forget_after_s: float = 3600.0  # stopped and failed replicas placed longer ago leave the state
    # A scheduler that has heard from no node yet (`llmgw up`'s agent starts a moment after it) waits
    # this long for one before it calls a model unplaceable for want of nodes.
    first_node_wait_s: float = 30.0
    # Preemption (SCHED-7); off for the headroom question, which asks what fits without taking anything.
    preempt: bool = True
    preempt_min_age_s: float = PRE.MIN_AGE_S
    preempt_max_victims: int = PRE.MAX_VICTIMS
    preempt_grace_s: float = PRE.GRACE_S
    preempt_hold_s: float = PRE.HOLD_S
    preempt_idle_s: float = 60.0  # an on-demand model with no request for this long: its replicas go first
    # Autoscaling (SCHED-9, services/scheduler/autoscale.py): between min and max, with the engines' load.
    scale_up_after_s: float = 60.0  # waiting requests held this long add a replica
    scale_down_after_s: float = 600.0  # nothing waiting this long removes one the load added
    scale_up_waiting_per_replica: float = 1.0
    scale_down_below: float = 0.7  # …if the busiest moment fits in the rest under this share of them


class Clock(msgspec.Struct, frozen=True, kw_only=True):
    """The times a pass is judged at, read once by the shell: the pass itself reads no clock."""

    monotonic: float  # for heartbeats this process saw
    epoch: float  # for event times (backoff)
    started: float  # monotonic time this scheduler started: a grace for nodes not yet heard from


def backoff_s(failures: int, cfg: Config) -> float:
    """Doubling backoff between start attempts: base, 2·base, 4·base, … up to the cap."""
    if failures <= 0:
        return 0.0
    return min(cfg.backoff_base_s * 2 ** (failures - 1), cfg.backoff_cap_s)


def backing_off(m: ModelState, clock: Clock, cfg: Config) -> Waiting | None:
    """A wait while ``m`` backs off after failed starts (:func:`backoff_s` since the last); None once it may try."""
    if m.failures and m.last_failure_at is not None:
        until = m.last_failure_at + backoff_s(m.failures, cfg)
        if clock.epoch < until:
            return Waiting(model=m.name, until=until)
    return None


# -- decisions ----------------------------------------------------------------------------------


class RegisterNode(msgspec.Struct, frozen=True, kw_only=True):
    """A node that reported in: registered, or its capacity changed (``node.registered``/``node.capacity_changed``)."""

    node_id: str
    capacity: N.NodeCapacity
    changed: bool  # an update of a known node, not a first registration


class MarkLost(msgspec.Struct, frozen=True, kw_only=True):
    """A node silent for ``lost_after_s`` (``node.lost``); its replicas each get a :class:`Fail`."""

    node_id: str
    silent_s: float


class MarkReturned(msgspec.Struct, frozen=True, kw_only=True):
    """A lost node heard from again (``node.returned``)."""

    node_id: str


class Place(msgspec.Struct, frozen=True, kw_only=True):
    """A new replica of ``model`` on ``node_id``, holding ``need`` and ``gpus`` (``replica.placed``)."""

    model: str
    node_id: str
    gpus: list[int]
    need: Need
    why: str
    profile: int = 0  # which of the model's profiles it runs (an index into spec.profiles)
    replaces: str = ""  # a restart's replacement (SCHED-6): the replica it replaces once ready


class Stop(msgspec.Struct, frozen=True, kw_only=True):
    """A replica asked to stop within ``grace_s`` (``replica.stop_requested``)."""

    replica_id: str
    reason: str
    grace_s: float
    short: bool = False  # the model holds fewer ready replicas than it should once this one stops


class Fail(msgspec.Struct, frozen=True, kw_only=True):
    """A replica on a lost node (the only failures the scheduler records itself)."""

    replica_id: str
    node_id: str
    reason: str


class Park(msgspec.Struct, frozen=True, kw_only=True):
    """A model that failed to start ``park_after`` times in a row: no more tries until a retry or an edit."""

    model: str
    reason: str
    failures: int


class Blocked(msgspec.Struct, frozen=True, kw_only=True):
    """``wanted`` replicas of a model that cannot be placed now: no node fits (unplaceable, with each
    node's ``verdicts``), a capacity limit, or no profile. The shell appends it as
    ``scheduler.unplaceable`` when its reason changes, else at most every ``BLOCKED_REPEAT_S``."""

    model: str
    reason: str
    wanted: int
    verdicts: list[Verdict] = []


class Waiting(msgspec.Struct, frozen=True, kw_only=True):
    """A model backing off between failed starts, held back after giving way, or waiting for the
    replicas that give way to it to drain; nothing to do until ``until``."""

    model: str
    until: float
    why: str = ""


class Preempt(msgspec.Struct, frozen=True, kw_only=True):
    """Replicas of ``model`` give way to ``for_model`` (SCHED-7); each also gets its own :class:`Stop`."""

    model: str
    replicas: list[str]
    node_id: str
    capacity_class: str
    for_model: str
    for_class: str
    reason: str
    at: float
    held_until: float


class Autoscale(msgspec.Struct, frozen=True, kw_only=True):
    """A step of autoscaling (SCHED-9, ``autoscale.py``): the model holds ``to`` replicas instead of
    ``from_`` (a ``model.autoscaled`` event)."""

    model: str
    from_: int
    to: int
    added: int
    reason: str
    at: float


Decision = RegisterNode | MarkLost | MarkReturned | Place | Stop | Fail | Park | Blocked | Waiting | Preempt | Autoscale


# -- decisions as events -------------------------------------------------------------------------


def event_of(
    d: Decision, state: ClusterState, *, replica_id: str, term: int, last_seen: datetime
) -> tuple[str, str, msgspec.Struct] | None:
    """(aggregate, id, payload) the shell appends for a decision; None for those it does not write
    as such (Waiting; Blocked, which the shell rate-limits). Pure, so tests fold exactly what the
    service would write. ``replica_id`` names a new replica; ``last_seen`` dates a lost node."""
    match d:
        case RegisterNode():
            cls = N.NodeCapacityChanged if d.changed else N.NodeRegistered
            return N.AGGREGATE, d.node_id, cls(node_id=d.node_id, capacity=d.capacity)
        case MarkLost():
            return N.AGGREGATE, d.node_id, N.NodeLost(node_id=d.node_id, last_seen=last_seen, silent_s=d.silent_s)
        case MarkReturned():
            return N.AGGREGATE, d.node_id, N.NodeReturned(node_id=d.node_id)
        case Fail():
            return (
                R.AGGREGATE,
                d.replica_id,
                R.ReplicaFailed(replica_id=d.replica_id, node_id=d.node_id, reason=d.reason, node_lost=True),
            )
        case Stop():
            return (
                R.AGGREGATE,
                d.replica_id,
                R.ReplicaStopRequested(replica_id=d.replica_id, reason=d.reason, grace_s=d.grace_s),
            )
        case Park():
            return M.AGGREGATE, d.model, M.ModelParked(reason=d.reason, failures=d.failures)
        case Autoscale():
            return (
                M.AGGREGATE,
                d.model,
                M.ModelAutoscaled(from_=d.from_, to=d.to, added=d.added, reason=d.reason, at=d.at),
            )
        case Preempt():
            return (
                M.AGGREGATE,
                d.model,
                M.ModelPreempted(
                    replicas=d.replicas,
                    node_id=d.node_id,
                    capacity_class=d.capacity_class,
                    for_model=d.for_model,
                    for_class=d.for_class,
                    reason=d.reason,
                    at=d.at,
                    held_until=d.held_until,
                ),
            )
        case Place():
            m = state.models[d.model]
            return (
                R.AGGREGATE,
                replica_id,
                R.ReplicaPlaced(
                    replica_id=replica_id,
                    model=d.model,
                    node_id=d.node_id,
                    source=m.spec.source,
                    profile=m.spec.profiles[d.profile],
                    spec_hash=m.spec_hash,
                    cores=d.need.cores,
                    memory_bytes=d.need.memory_bytes,
                    gpus=d.gpus,
                    term=term,
                    why=d.why,
                    replaces=d.replaces,
                ),
            )
    return None
