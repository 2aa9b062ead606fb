"""The fleet service: `ctl cordon|uncordon|drain NODE` (SPEC FLEET-4) as node events, and
`ctl restart REPLICA` (SCHED-6) as a replica event.

Its state and rules are :mod:`.rules` (pure); :class:`~llmgw.events.commands.shell.CommandShell`
does the rest.
"""

from __future__ import annotations

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import CommandShell
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import nodes as N
from llmgw.services.fleet import rules


class FleetService:
    def __init__(
        self, store: EventStore, *, folds: FollowerRegistry | None = None, verifier: CommandVerifier | None = None
    ) -> None:
        self.store = store
        self.state = rules.FleetState()
        self.fold = Followers(store, rules.SUBJECTS, self.state.apply, registry=folds)
        self.shell = CommandShell(
            store,
            service=N.SERVICE,
            what="the fleet",
            fold=self.fold,
            state=self.state,
            decide=rules.decide,
            payload_type=rules.FleetCommand,
            verifier=verifier,
        )

    def start(self) -> None:
        """Follow the log from now on (the first command would start it otherwise)."""
        self.fold.start()

    async def close(self) -> None:
        await self.fold.close()

    def processor(self) -> CommandProcessor:
        return self.shell.processor()
