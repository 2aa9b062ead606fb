"""Replicas: one running copy of a model on a node, and its lifecycle (SPEC SCHED-2).

``placed → starting → ready → draining → stopped``, or ``failed``. The scheduler writes
``replica.placed`` and ``replica.stop_requested`` (fenced by its leadership term); the agent on
the node writes what it observes: ``starting``, ``ready``, ``failed``, ``stopped``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw.events.schema.models import Profile
from llmgw.events.schema.registry import EventType

AGGREGATE = "replica"

STATES = ("placed", "starting", "ready", "draining", "stopped", "failed")
ACTIVE = ("placed", "starting", "ready")


class ReplicaPlaced(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    model: str
    node_id: str
    source: str
    profile: Profile
    spec_hash: str
    cores: int = 0
    memory_bytes: int = 0
    gpus: list[int] = []
    term: int = 0
    why: str = ""
    replaces: str = ""  # a restart with surge (SCHED-6): the replica this one replaces once it is ready


class ReplicaStarting(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    node_id: str
    pid: int
    port: int


class ReplicaReady(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    node_id: str
    pid: int
    port: int
    url: str
    startup_s: float = 0.0


class ReplicaFailed(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    node_id: str
    reason: str
    exit_code: int | None = None
    log_tail: list[str] = []
    # v2: the replica's node was lost (the scheduler says so); not the model's fault, so it does not
    # count towards parking. v1 events said it only in the reason's wording (see UPCASTERS).
    node_lost: bool = False


class ReplicaStopRequested(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    reason: str
    grace_s: float = 30.0


class ReplicaStopped(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    node_id: str
    reason: str = ""


class ReplicaRestartRequested(msgspec.Struct, frozen=True, kw_only=True):
    """`ctl restart`: the scheduler replaces the replica, a new copy first (SCHED-6); the envelope says who asked."""

    replica_id: str
    reason: str = ""


EVENTS = (
    EventType("replica.placed", 1, ReplicaPlaced, "The scheduler placed a replica of a model on a node."),
    EventType("replica.starting", 1, ReplicaStarting, "The node's agent started the replica's engine."),
    EventType("replica.ready", 1, ReplicaReady, "The engine answers its health probe; the replica serves."),
    EventType(
        "replica.failed", 2, ReplicaFailed, "The replica's engine exited or never became ready, or its node was lost."
    ),
    EventType(
        "replica.stop_requested", 1, ReplicaStopRequested, "The scheduler asked for the replica to drain and stop."
    ),
    EventType("replica.stopped", 1, ReplicaStopped, "The replica's engine was stopped."),
    EventType(
        "replica.restart_requested",
        1,
        ReplicaRestartRequested,
        "Someone asked for the replica to be restarted: replaced by a new copy first, then stopped.",
    ),
)


class RestartReplica(msgspec.Struct, frozen=True, kw_only=True, tag="restart", forbid_unknown_fields=True):
    """`ctl restart REPLICA`: one command per replica (the CLI names each one of a model or of all)."""

    replica_id: str
    reason: str = ""


def _failed_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v1 told a lost node only by the scheduler's wording, ``node N lost…``; v2 says it in ``node_lost``."""
    return {**data, "node_lost": str(data.get("reason", "")).startswith("node ")}


# (type, from version, upcaster): registered by events/schema/catalog.py's default_registry
UPCASTERS = (("replica.failed", 1, _failed_v1_to_v2),)
