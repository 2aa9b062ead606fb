"""The fleet's rules: `ctl cordon|uncordon|drain NODE` (SPEC FLEET-4) and `ctl restart REPLICA` (SCHED-6),
pure decisions over the nodes and the running replicas as the shared folds keep them.

The scheduler acts on the events: a cordoned node takes no new replicas; a draining node's replicas
are replaced elsewhere first, then stopped with the drain's grace.
"""

from __future__ import annotations

from datetime import datetime

from llmgw.events.commands.shell import Decision
from llmgw.events.folds import nodes as NF
from llmgw.events.folds import replicas as F
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject

# The fleet service's commands: the node ones, and restarting a replica.
FleetCommand = N.FleetCommand | R.RestartReplica

# What the state folds, each subject filter with the name its follower shows on /healthz.
SUBJECTS = {f"{EVENTS_ROOT}.{N.AGGREGATE}.>": "fleet", f"{EVENTS_ROOT}.{R.AGGREGATE}.>": "fleet-replicas"}


class FleetState:
    """The nodes and the running replicas (a restart names one), as the shared folds
    (events/folds/nodes.py, events/folds/replicas.py) keep them; changed only by :meth:`apply`."""

    def __init__(self) -> None:
        self.nodes: dict[str, NF.Node] = {}  # node id -> the node
        self.replicas: dict[str, F.Replica] = {}  # replica id -> the replica, while it runs

    def apply(self, event: RecordedEvent) -> None:
        aggregate, aggregate_id = aggregate_of(event.subject)
        at = event.envelope.at.timestamp()
        if aggregate == R.AGGREGATE:
            r = F.fold_replica(self.replicas.get(aggregate_id), event.payload, at)
            if r is not None and r.active:
                self.replicas[aggregate_id] = r
            else:  # only a running replica restarts: the others need not be kept
                self.replicas.pop(aggregate_id, None)
        elif isinstance(event.payload, NF.NODE_EVENTS):
            self.nodes[aggregate_id] = NF.fold_node(self.nodes.get(aggregate_id), event.payload, at)


def decide_node(node_state: NF.Node | None, command: N.FleetCommand) -> Decision:
    """Pure: the node as the shared fold keeps it (None: no event yet) and a command → its decision."""
    node = command.node_id
    if node_state is None or not node_state.registered:
        raise Rejected(f"there is no node {node!r}: `llmgw ctl nodes` lists them", "not_found")
    subject = event_subject(N.AGGREGATE, node)
    cordoned, draining = node_state.cordoned, node_state.draining
    match command:
        case N.CordonNode():
            if cordoned:
                raise Rejected(f"node {node} is already cordoned", "unchanged")
            payload = N.NodeCordoned(node_id=node, reason=command.reason)
            return Decision(subject=subject, payloads=[payload], message=f"node {node} cordoned: no new replicas")
        case N.UncordonNode():
            if not cordoned:
                raise Rejected(f"node {node} is not cordoned", "unchanged")
            payload = N.NodeUncordoned(node_id=node)
            return Decision(subject=subject, payloads=[payload], message=f"node {node} uncordoned")
        case N.DrainNode():
            if draining:
                raise Rejected(f"node {node} is already draining", "unchanged")
            if command.grace_s < 0:
                raise Rejected("the drain grace cannot be negative", "invalid")
            return Decision(
                subject=subject,
                payloads=[N.NodeDrainRequested(node_id=node, grace_s=command.grace_s)],
                message=f"node {node} draining: its replicas move elsewhere, then stop within {command.grace_s:.0f}s",
            )
    raise Rejected(f"unknown fleet command {type(command).__name__}")


def decide_restart(replicas: dict[str, F.Replica], command: R.RestartReplica) -> Decision:
    """Pure: the running replicas as the shared fold keeps them and a restart → its decision."""
    rid = command.replica_id
    r = replicas.get(rid)
    if r is None:
        running = sorted(replicas)
        some = ", ".join(running[:8]) + (f" and {len(running) - 8} more" if len(running) > 8 else "")
        known = f"running: {some}" if running else "none is running"
        raise Rejected(f"there is no running replica {rid!r} ({known}): `llmgw ctl replicas` lists them", "not_found")
    subject, result = event_subject(R.AGGREGATE, rid), {"replica": rid}
    if r.restart:
        return Decision(
            subject=subject, message=f"replica {rid} ({r.model}) is already restarting ({r.restart})", result=result
        )
    return Decision(
        subject=subject,
        payloads=[R.ReplicaRestartRequested(replica_id=rid, reason=command.reason)],
        message=f"replica {rid} ({r.model}) restarts: a new copy starts first, then it stops",
        result=result,
    )


def decide(state: FleetState, command: FleetCommand, now: datetime) -> Decision:
    """Pure: a fleet command over the nodes and replicas → its :class:`Decision`, or a refusal."""
    if isinstance(command, R.RestartReplica):
        return decide_restart(state.replicas, command)
    return decide_node(state.nodes.get(command.node_id), command)
