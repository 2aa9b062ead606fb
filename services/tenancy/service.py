"""The tenancy service: owns the tenancy tree aggregate and handles its commands.

Thin I/O around :mod:`.tree`: catch the folded tree up with the log, decide (pure), append with
the tree's expected sequence; on a conflict, catch up and decide again. The service also folds
the key events (``llmgw.evt.key.>``), so a project that still holds live keys is not deleted.
"""

from __future__ import annotations

import msgspec
import structlog

from llmgw.events import access as A
from llmgw.events import tenancy as T
from llmgw.events.commands import Accepted, Command, CommandProcessor, Rejected
from llmgw.events.envelope import RecordedEvent
from llmgw.events.store import AppendConflict, EventStore, NewEvent
from llmgw.events.subjects import EVENTS_ROOT, event_subject
from llmgw.services.tenancy.tree import TenancyTree, decide

log = structlog.get_logger("llmgw.services.tenancy")

MAX_ATTEMPTS = 5


class TenancyService:
    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.tree = TenancyTree()
        self.subject = event_subject(T.AGGREGATE, T.TREE_ID)
        self.keys_subject = f"{EVENTS_ROOT}.{A.KEY_AGGREGATE}.>"

    async def catch_up(self) -> None:
        # A key is created only while the tree is unchanged (the access service fences on it), so a key
        # for a project deleted meanwhile is refused; a key created between this read and the delete's
        # append is the one race left, milliseconds wide (docs/decisions.md).
        # The last sequence on a subject says whether there is anything to read, and up to where: a filtered
        # read then ends on that event instead of waiting to be sure nothing else matches.
        last_key = await self.store.last_seq(self.keys_subject)
        if last_key > self.tree.keys_seq:
            async for batch in self.store.subscribe(
                self.keys_subject, after=self.tree.keys_seq, follow=False, until=last_key
            ):
                for event in batch:
                    if isinstance(event, RecordedEvent):
                        self.tree.apply_key(event)
            self.tree.keys_seq = max(self.tree.keys_seq, last_key)  # quarantined positions are moved past too
        if await self.store.last_seq(self.subject) > self.tree.last_seq:
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
