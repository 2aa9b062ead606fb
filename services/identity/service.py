"""The identity service: owns the ``idp`` and ``scimgroup`` aggregates and handles `llmgw ctl sso|ldap|scim …`.

Its rules are :mod:`.rules` (pure); :class:`~llmgw.events.commands.shell.CommandShell` does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import CommandShell
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import identity as I
from llmgw.events.schema.envelope import utc_now
from llmgw.services.identity import rules


class IdentityService:
    def __init__(
        self,
        store: EventStore,
        *,
        folds: FollowerRegistry | None = None,
        clock: Callable[[], datetime] = utc_now,
        verifier: CommandVerifier | None = None,
    ) -> None:
        self.store = store
        self.folded = rules.IdentityAndTree()
        self.identity, self.tree = self.folded.identity, self.folded.tree
        self.fold = Followers(store, rules.IdentityAndTree.subjects("identity"), self.folded.apply, registry=folds)
        self.shell = CommandShell(
            store,
            service=I.SERVICE,
            what="the identity providers",
            fold=self.fold,
            state=self.folded,
            decide=rules.decide,
            payload_type=I.IdentityCommand,
            authorize=lambda command, payload: rules.need(payload),
            verifier=verifier,
            clock=clock,
        )

    def start(self) -> None:
        self.fold.start()

    async def close(self) -> None:
        await self.fold.close()

    def processor(self) -> CommandProcessor:
        return self.shell.processor()
