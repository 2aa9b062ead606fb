"""Scheduler leadership and decisions that are about no single model or replica."""

from __future__ import annotations

import msgspec

from llmgw.events.schema.registry import EventType

AGGREGATE = "scheduler"
LEADER_ID = "leader"

# Request/reply subjects every scheduler instance serves (a queue group): the body is a model name,
# the answer JSON (``{"error": …}`` for an unknown model).
EXPLAIN_SUBJECT = "llmgw.rpc.scheduler.explain"  # SCHED-3
HEADROOM_SUBJECT = "llmgw.rpc.scheduler.headroom"  # SCHED-11

# Routers' queues (SCHED-9): a gateway holds a request when every ready replica of its model is
# saturated, so that engines never queue it; what waits there is load the engines' metrics cannot
# see. Each router publishes :class:`RouterQueues` on ``QUEUE_ROOT.<router>`` (core NATS, not the
# log) about every second while a model has requests waiting, and once more when they are gone.
QUEUE_ROOT = "llmgw.queue"


class RouterQueues(msgspec.Struct, frozen=True, kw_only=True):
    """One router's waiting requests per model, now (a model absent or at 0: none waiting there)."""

    router: str
    waiting: dict[str, int] = {}


class LeaderElected(msgspec.Struct, frozen=True, kw_only=True):
    """A scheduler became leader. Its decisions are fenced by this event's sequence: once another
    leader is elected, the old one's appends are refused (SCHED-13)."""

    instance: str
    term: int


class PlacementBlocked(msgspec.Struct, frozen=True, kw_only=True):
    """A model could not be placed; logged when the reason changes or every 10 minutes (SCHED-3)."""

    model: str
    reason: str
    wanted: int


EVENTS = (
    EventType("scheduler.elected", 1, LeaderElected, "A scheduler instance took the lead, with its term."),
    EventType("scheduler.unplaceable", 1, PlacementBlocked, "A model could not be placed, and why."),
)
