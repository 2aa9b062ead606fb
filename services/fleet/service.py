"""The fleet service: `ctl cordon|uncordon|drain NODE` (SPEC FLEET-4) as node events, and
`ctl restart REPLICA` (SCHED-6) as a replica event.

The scheduler acts on them: a cordoned node takes no new replicas; a draining node's replicas
are replaced elsewhere first, then stopped with the drain's grace. :func:`decide` is the rules;
:class:`~llmgw.events.commands.shell.CommandShell` does the rest.
"""

from __future__ import annotations

import msgspec

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.command import Command
from llmgw.events.commands.processor import CommandProcessor, Rejected
from llmgw.events.commands.shell import CommandShell, Decision
from llmgw.events.folds import nodes as NF
from llmgw.events.folds import replicas as F
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject


def decide(node_state: NF.Node | None, command: N.FleetCommand) -> tuple[list[msgspec.Struct], str]:
    """Pure: the node as the shared fold keeps it (None: no event yet) and a command → payloads and a message."""
    node = command.node_id
    if node_state is None or not node_state.registered:
        raise Rejected(f"there is no node {node!r}: `llmgw ctl nodes` lists them", "not_found")
    cordoned, draining = node_state.cordoned, node_state.draining
    match command:
        case N.CordonNode():
            if cordoned:
                raise Rejected(f"node {node} is already cordoned", "unchanged")
            return [N.NodeCordoned(node_id=node, reason=command.reason)], f"node {node} cordoned: no new replicas"
        case N.UncordonNode():
            if not cordoned:
                raise Rejected(f"node {node} is not cordoned", "unchanged")
            return [N.NodeUncordoned(node_id=node)], f"node {node} uncordoned"
        case N.DrainNode():
            if draining:
                raise Rejected(f"node {node} is already draining", "unchanged")
            if command.grace_s < 0:
                raise Rejected("the drain grace cannot be negative", "invalid")
            return (
                [N.NodeDrainRequested(node_id=node, grace_s=command.grace_s)],
                f"node {node} draining: its replicas move elsewhere, then stop within {command.grace_s:.0f}s",
            )
    raise Rejected(f"unknown fleet command {type(command).__name__}")


# The fleet service's commands: the node ones, and restarting a replica.
FleetCommand = N.FleetCommand | R.RestartReplica


def decide_restart(replicas: dict[str, F.Replica], command: R.RestartReplica) -> tuple[list[msgspec.Struct], str]:
    """Pure: the running replicas as the shared fold keeps them and a restart → payloads and a message."""
    rid = command.replica_id
    r = replicas.get(rid)
    if r is None:
        running = sorted(replicas)
        some = ", ".join(running[:8]) + (f" and {len(running) - 8} more" if len(running) > 8 else "")
        known = f"running: {some}" if running else "none is running"
        raise Rejected(f"there is no running replica {rid!r} ({known}): `llmgw ctl replicas` lists them", "not_found")
    if r.restart:
        return [], f"replica {rid} ({r.model}) is already restarting ({r.restart})"
    return (
        [R.ReplicaRestartRequested(replica_id=rid, reason=command.reason)],
        f"replica {rid} ({r.model}) restarts: a new copy starts first, then it stops",
    )


class FleetService:
    def __init__(
        self, store: EventStore, *, folds: FollowerRegistry | None = None, verifier: CommandVerifier | None = None
    ) -> None:
        self.store = store
        self.nodes: dict[str, NF.Node] = {}  # node id -> the node as the shared fold (events/folds/nodes.py) keeps it
        self.seqs: dict[str, int] = {}  # node id -> last sequence on its subject
        # Running replicas (a restart names one), as the shared fold keeps them, and their subjects' sequences.
        self.replicas: dict[str, F.Replica] = {}
        self.replica_seqs: dict[str, int] = {}
        subjects = {f"{EVENTS_ROOT}.{N.AGGREGATE}.>": "fleet", f"{EVENTS_ROOT}.{R.AGGREGATE}.>": "fleet-replicas"}
        self.fold = Followers(store, subjects, self._apply, registry=folds)
        self.shell = CommandShell(
            store,
            service=N.SERVICE,
            what="the fleet",
            fold=self.fold,
            decide=self.decide,
            payload_type=FleetCommand,
            verifier=verifier,
        )

    def _apply(self, event: RecordedEvent) -> None:
        aggregate, node = aggregate_of(event.subject)
        if aggregate == R.AGGREGATE:
            self._apply_replica(node, event)
            return
        self.seqs[node] = event.seq  # first: an event the fold raises on (quarantined) is still passed
        if isinstance(event.payload, NF.NODE_EVENTS):
            self.nodes[node] = NF.fold_node(self.nodes.get(node), event.payload, event.envelope.at.timestamp())

    def _apply_replica(self, rid: str, event: RecordedEvent) -> None:
        r = F.fold_replica(self.replicas.get(rid), event.payload, event.envelope.at.timestamp())
        if r is not None and r.active:
            self.replicas[rid], self.replica_seqs[rid] = r, event.seq
        else:  # only a running replica restarts: the others need not be kept
            self.replicas.pop(rid, None)
            self.replica_seqs.pop(rid, None)

    def start(self) -> None:
        """Follow the log from now on (the first command would start it otherwise)."""
        self.fold.start()

    async def close(self) -> None:
        await self.fold.close()

    def decide(self, command: Command, payload: FleetCommand) -> Decision:
        if isinstance(payload, R.RestartReplica):
            rid = payload.replica_id
            payloads, message = decide_restart(self.replicas, payload)
            return Decision(
                subject=event_subject(R.AGGREGATE, rid),
                payloads=payloads,
                expected=self.replica_seqs.get(rid, 0),
                message=message,
                result={"replica": rid},
            )
        node = payload.node_id
        payloads, message = decide(self.nodes.get(node), payload)
        return Decision(
            subject=event_subject(N.AGGREGATE, node),
            payloads=payloads,
            expected=self.seqs.get(node, 0),
            message=message,
        )

    def processor(self) -> CommandProcessor:
        return self.shell.processor()
