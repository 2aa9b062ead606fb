"""The access service: owns keys, limits, prices and budgets, and handles their commands.

Its state and rules are :mod:`.rules` (pure); :class:`~llmgw.events.commands.shell.CommandShell` does
the rest: catch the folded state up with the log (the tenancy tree and the ``key``, ``limit``,
``price`` and ``budget`` aggregates), decide, append with the aggregate's expected sequence, and on a
conflict catch up and decide again. A new key is appended fenced on the tenancy tree's sequence, so a
key is never created for a project deleted meanwhile.
"""

from __future__ import annotations

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import CommandShell
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import access as A
from llmgw.services.access import rules


class AccessService:
    def __init__(
        self, store: EventStore, *, folds: FollowerRegistry | None = None, verifier: CommandVerifier | None = None
    ) -> None:
        self.store = store
        self.state = rules.AccessState()
        self.fold = Followers(store, rules.SUBJECTS, self.state.apply, registry=folds)
        self.shell = CommandShell(
            store,
            service=A.SERVICE,
            what="the access settings",
            fold=self.fold,
            state=self.state,
            decide=rules.decide,
            payload_type=A.AccessCommand,
            authorize=lambda command, payload: rules.need(self.state, payload),
            verifier=verifier,
        )

    def start(self) -> None:
        """Follow the log from now on (the first command would start it otherwise)."""
        self.fold.start()

    async def close(self) -> None:
        await self.fold.close()

    async def catch_up(self) -> None:
        await self.fold.catch_up()

    def processor(self) -> CommandProcessor:
        return self.shell.processor()
