"""The catalog service: owns model aggregates and handles `ctl model …` commands.

Its rules are :mod:`.rules` (pure); :class:`~llmgw.events.commands.shell.CommandShell` does the rest.
"""

from __future__ import annotations

import math
from pathlib import Path

import structlog

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import CommandShell
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import models as M
from llmgw.events.schema.subjects import event_subject
from llmgw.services.catalog.rules import SUBJECTS, Catalog, decide

log = structlog.get_logger("llmgw.services.catalog")


class CatalogService:
    def __init__(
        self, store: EventStore, *, folds: FollowerRegistry | None = None, verifier: CommandVerifier | None = None
    ) -> None:
        self.store = store
        self.catalog = Catalog()
        self.fold = Followers(store, SUBJECTS, self.catalog.apply_event, registry=folds)
        self.shell = CommandShell(
            store,
            service=M.SERVICE,
            what="the catalog",
            fold=self.fold,
            state=self.catalog,
            decide=decide,
            payload_type=M.CatalogCommand,
            verifier=verifier,
        )

    def start(self) -> None:
        """Follow the log from now on (the first command would start it otherwise)."""
        self.fold.start()

    async def close(self) -> None:
        await self.fold.close()

    async def catch_up(self, timeout: float | None = None) -> None:
        await self.fold.catch_up(timeout)

    async def sync_declared(self, specs: list[M.ModelSpec]) -> None:
        """Bring models declared in the catalog file into the log (CAT-3): added or changed as declared."""
        await self.catch_up(math.inf)  # at start: as long as reading the log takes
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
        await self.catch_up(math.inf)  # at start: as long as reading the log takes
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
        return self.shell.processor()
