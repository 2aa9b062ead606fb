"""The access service: owns keys, limits, prices and budgets, and handles their commands.

Thin I/O around :mod:`.rules`: catch the folded state up with the log (the tenancy tree and the
``key``, ``limit``, ``price`` and ``budget`` aggregates), decide (pure), append with the
aggregate's expected sequence; on a conflict, catch up and decide again. A new key is appended
fenced on the tenancy tree's sequence, so a key is never created for a project deleted meanwhile.
"""

from __future__ import annotations

import structlog

from llmgw.events import access as A
from llmgw.events import tenancy as T
from llmgw.events.commands import Accepted, Command, CommandProcessor, Rejected
from llmgw.events.envelope import RecordedEvent, utc_now
from llmgw.events.store import AppendConflict, AppendResult, EventStore, NewEvent
from llmgw.events.subjects import EVENTS_ROOT, event_subject
from llmgw.services.access.rules import AccessState, Decision, decide

log = structlog.get_logger("llmgw.services.access")

MAX_ATTEMPTS = 5


class AccessService:
    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.state = AccessState()
        self.tree_subject = event_subject(T.AGGREGATE, T.TREE_ID)
        # What the state folds, each read from its own position.
        self.positions: dict[str, int] = {
            self.tree_subject: 0,
            **{
                f"{EVENTS_ROOT}.{aggregate}.>": 0
                for aggregate in (A.KEY_AGGREGATE, A.LIMIT_AGGREGATE, A.PRICE_AGGREGATE, A.BUDGET_AGGREGATE)
            },
        }

    async def catch_up(self) -> None:
        for subject, after in self.positions.items():
            # The last sequence on the subject (wildcards included) says whether there is anything to read,
            # and up to where: a filtered read then ends on that event instead of waiting to be sure.
            last = await self.store.last_seq(subject)
            if last <= after:
                continue
            async for batch in self.store.subscribe(subject, after=after, follow=False, until=last):
                for event in batch:
                    if isinstance(event, RecordedEvent):
                        self.state.apply(event)
            self.positions[subject] = last  # quarantined positions are moved past too

    async def handle(self, command: Command, payload: A.AccessCommand) -> Accepted:
        for _ in range(MAX_ATTEMPTS):
            await self.catch_up()
            if command.id in self.state.applied_commands:
                # Redelivered after its events were written but before its outcome was.
                return Accepted(message="already applied", last_seq=self.state.applied_commands[command.id])
            decision = decide(self.state, payload, utc_now())
            events = [
                NewEvent(payload=p, actor=command.actor, causation=command.id, correlation=command.correlation)
                for p in decision.payloads
            ]
            try:
                result = await self._append(decision, events)
            except AppendConflict:
                continue
            return Accepted(
                message=decision.message,
                events=[e.id for e in events],
                last_seq=result.last_seq,
                result=decision.result,
            )
        raise Rejected("access settings kept changing while this command was decided; send it again", "busy")

    async def _append(self, decision: Decision, events: list[NewEvent]) -> AppendResult:
        if decision.fence_tree:
            return await self.store.append_fenced(
                [(decision.subject, e) for e in events],
                fence_subject=self.tree_subject,
                fence_seq=self.state.tree.last_seq,
            )
        expected = self.state.subject_seqs.get(decision.subject, 0)
        return await self.store.append(decision.subject, events, expected=expected)

    def processor(self) -> CommandProcessor:
        return CommandProcessor(self.store, A.SERVICE, A.AccessCommand, self.handle)
