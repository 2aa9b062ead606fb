"""The tenancy service: owns the tenancy tree aggregate and handles its commands.

Thin I/O around :mod:`.tree`: catch the folded tree up with the log, decide (pure), append with
the tree's expected sequence; on a conflict, catch up and decide again.
"""

from __future__ import annotations

import msgspec
import structlog

from llmgw.events import tenancy as T
from llmgw.events.commands import Accepted, Command, CommandProcessor, Rejected
from llmgw.events.store import AppendConflict, EventStore, NewEvent
from llmgw.events.subjects import event_subject
from llmgw.services.tenancy.tree import TenancyTree, decide

log = structlog.get_logger("llmgw.services.tenancy")

MAX_ATTEMPTS = 5


class TenancyService:
    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.tree = TenancyTree()
        self.subject = event_subject(T.AGGREGATE, T.TREE_ID)

    async def catch_up(self) -> None:
        for event in await self.store.read(self.subject, after=self.tree.last_seq):
            self.tree.apply(event)

    async def handle(self, command: Command, payload: T.TenancyCommand) -> Accepted:
        for _ in range(MAX_ATTEMPTS):
            await self.catch_up()
            if command.id in self.tree.applied_commands:
                # Redelivered after its events were written but before its outcome was.
                return Accepted(message="already applied", last_seq=self.tree.applied_commands[command.id])
            payloads = decide(self.tree, payload)
            events = [
                NewEvent(payload=p, actor=command.actor, causation=command.id, correlation=command.correlation)
                for p in payloads
            ]
            try:
                result = await self.store.append(self.subject, events, expected=self.tree.last_seq)
            except AppendConflict:
                continue
            return Accepted(
                message=describe(payload),
                events=[e.id for e in events],
                last_seq=result.last_seq,
                result={"id": scope_id(payloads[0])},
            )
        raise Rejected("the tenancy tree kept changing while this command was decided; send it again", "busy")

    def processor(self) -> CommandProcessor:
        return CommandProcessor(self.store, T.SERVICE, T.TenancyCommand, self.handle)


def describe(command: T.TenancyCommand) -> str:
    match command:
        case T.CreateScope():
            return f"{command.kind} {command.path} created"
        case T.RenameScope():
            return f"{command.kind} {command.path} renamed to {command.name}"
        case T.DeleteScope():
            return f"{command.kind} {command.path} deleted"
    return "done"


def scope_id(payload: msgspec.Struct) -> str:
    for field in ("project_id", "team_id", "org_id"):  # most specific first: a team names its org too
        if hasattr(payload, field):
            return getattr(payload, field)
    return ""
