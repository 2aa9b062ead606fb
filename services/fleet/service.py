"""The fleet service: `ctl cordon|uncordon|drain NODE` (SPEC FLEET-4) as node events.

The scheduler acts on them: a cordoned node takes no new replicas; a draining node's replicas
are replaced elsewhere first, then stopped with the drain's grace.
"""

from __future__ import annotations

import msgspec

from llmgw.events import nodes as N
from llmgw.events.commands import Accepted, Command, CommandProcessor, Rejected
from llmgw.events.store import AppendConflict, EventStore, NewEvent
from llmgw.events.subjects import event_subject


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

    async def handle(self, command: Command, payload: N.FleetCommand) -> Accepted:
        subject = event_subject(N.AGGREGATE, payload.node_id)
        for _ in range(5):
            history = await self.store.read(subject)
            if any(e.envelope.causation == command.id for e in history):
                return Accepted(message="already applied", last_seq=history[-1].seq)
            payloads, message = decide([e.payload for e in history], payload)
            events = [NewEvent(payload=p, actor=command.actor, causation=command.id) for p in payloads]
            try:
                result = await self.store.append(subject, events, expected=history[-1].seq if history else 0)
            except AppendConflict:
                continue
            return Accepted(message=message, events=[e.id for e in events], last_seq=result.last_seq)
        raise Rejected("the node kept changing while this command was decided; send it again", "busy")

    def processor(self) -> CommandProcessor:
        return CommandProcessor(self.store, N.SERVICE, N.FleetCommand, self.handle)
