"""The catalog service: owns model aggregates and handles `ctl model …` commands."""

from __future__ import annotations

from pathlib import Path

import structlog

from llmgw.events import models as M
from llmgw.events.commands import Accepted, Command, CommandProcessor, Rejected
from llmgw.events.store import AppendConflict, EventStore, NewEvent
from llmgw.events.subjects import EVENTS_ROOT, aggregate_of, event_subject
from llmgw.services.catalog.rules import Catalog, decide

log = structlog.get_logger("llmgw.services.catalog")

MAX_ATTEMPTS = 5


class CatalogService:
    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.catalog = Catalog()

    async def catch_up(self) -> None:
        after = self.catalog.position
        async for batch in self.store.subscribe(f"{EVENTS_ROOT}.{M.AGGREGATE}.>", after=after, follow=False):
            for e in batch:
                if hasattr(e, "envelope"):
                    _, name = aggregate_of(e.subject)
                    self.catalog.apply(name, e)
                else:
                    self.catalog.position = max(self.catalog.position, e.seq)

    async def handle(self, command: Command, payload: M.CatalogCommand) -> Accepted:
        for _ in range(MAX_ATTEMPTS):
            await self.catch_up()
            if command.id in self.catalog.applied_commands:
                return Accepted(message="already applied", last_seq=self.catalog.applied_commands[command.id])
            name, payloads, message = decide(self.catalog, payload)
            entry = self.catalog.models.get(name)
            expected = entry.seq if entry else await self.store.last_seq(event_subject(M.AGGREGATE, name))
            events = [NewEvent(payload=p, actor=command.actor, causation=command.id) for p in payloads]
            try:
                result = await self.store.append(event_subject(M.AGGREGATE, name), events, expected=expected)
            except AppendConflict:
                continue
            return Accepted(
                message=message, events=[e.id for e in events], last_seq=result.last_seq, result={"model": name}
            )
        raise Rejected("the catalog kept changing while this command was decided; send it again", "busy")

    async def sync_declared(self, specs: list[M.ModelSpec]) -> None:
        """Bring models declared in the catalog file into the log (CAT-3): added or changed as declared."""
        await self.catch_up()
        from llmgw.services.catalog.rules import validate_catalog, validate_spec

        for spec in specs:
            validate_spec(spec)
        validate_catalog({n: e.spec for n, e in self.catalog.models.items()} | {s.name: s for s in specs})
        for spec in specs:
            entry = self.catalog.models.get(spec.name)
            subject = event_subject(M.AGGREGATE, spec.name)
            if entry is None:
                payloads = [M.ModelAdded(spec=spec, declared=True)]
            elif entry.spec != spec:
                payloads = [M.ModelChanged(spec=spec, what="catalog file")]
                if (entry.min, entry.max) != (spec.scaling.min, spec.scaling.upper):
                    payloads.append(M.ModelScaled(min=spec.scaling.min, max=spec.scaling.upper))
            else:
                continue
            await self.store.append(
                subject,
                [NewEvent(payload=p, actor="svc:catalog") for p in payloads],
                expected=entry.seq if entry else 0,
            )
            log.info("declared model synced", model=spec.name)

    async def add_once(self, spec: M.ModelSpec, marker: Path) -> bool:
        """Add ``spec`` as a runtime model the first time only (the demo): removed later, it stays removed."""
        if marker.exists():
            return False
        await self.catch_up()
        if spec.name not in self.catalog.models:
            subject = event_subject(M.AGGREGATE, spec.name)
            await self.store.append(
                subject,
                [NewEvent(payload=M.ModelAdded(spec=spec), actor="svc:catalog")],
                expected=await self.store.last_seq(subject),
            )
            log.info("demo model added", model=spec.name, source=spec.source)
        marker.write_text(spec.name + "\n")
        return True

    def processor(self) -> CommandProcessor:
        return CommandProcessor(self.store, M.SERVICE, M.CatalogCommand, self.handle)
