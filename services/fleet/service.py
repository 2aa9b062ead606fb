"""The fleet service: `ctl cordon|uncordon|drain NODE` (SPEC FLEET-4) as node events.

The scheduler acts on them: a cordoned node takes no new replicas; a draining node's replicas
are replaced elsewhere first, then stopped with the drain's grace. :func:`decide` is the rules;
:class:`~llmgw.events.command_shell.CommandShell` does the rest.
"""

from __future__ import annotations

import msgspec

from llmgw.events import nodes as N
from llmgw.events.command_shell import CommandShell, Decision, LogFold
from llmgw.events.commands import Command, CommandProcessor, Rejected
from llmgw.events.envelope import RecordedEvent
from llmgw.events.store import EventStore
from llmgw.events.subjects import EVENTS_ROOT, aggregate_of, event_subject


def decide(history: list[msgspec.Struct], command: N.FleetCommand) -> tuple[list[msgspec.Struct], str]:
    """Pure: the node's history (payloads, in order) and a command → payloads and a message."""
    node = command.node_id
    if not any(isinstance(p, N.NodeRegistered) for p in history):
        raise Rejected(f"there is no node {node!r}: `llmgw ctl nodes` lists them", "not_found")
    cordoned = draining = False
    for p in history:
        if isinstance(p, N.NodeCordoned):
            cordoned = True
        elif isinstance(p, N.NodeDrainRequested):
            cordoned = draining = True
        elif isinstance(p, N.NodeUncordoned):
            cordoned = draining = False
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


class FleetService:
    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.histories: dict[str, list[msgspec.Struct]] = {}  # node id -> its events' payloads, in order
        self.seqs: dict[str, int] = {}  # node id -> last sequence on its subject
        self.fold = LogFold(store, [f"{EVENTS_ROOT}.{N.AGGREGATE}.>"], self._apply)
        self.shell = CommandShell(
            store, service=N.SERVICE, what="the node", fold=self.fold, decide=self.decide, payload_type=N.FleetCommand
        )

    def _apply(self, event: RecordedEvent) -> None:
        _, node = aggregate_of(event.subject)
        self.histories.setdefault(node, []).append(event.payload)
        self.seqs[node] = event.seq

    def decide(self, command: Command, payload: N.FleetCommand) -> Decision:
        node = payload.node_id
        payloads, message = decide(self.histories.get(node, []), payload)
        return Decision(
            subject=event_subject(N.AGGREGATE, node),
            payloads=payloads,
            expected=self.seqs.get(node, 0),
            message=message,
        )

    def processor(self) -> CommandProcessor:
        return self.shell.processor()
