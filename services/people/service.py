"""The people service: owns the ``user`` aggregates and handles `llmgw ctl user …` and token commands.

Its rules are :mod:`.rules` (pure); :class:`~llmgw.events.commands.shell.CommandShell` does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import CommandShell
from llmgw.events.folds.people import PeopleAndTree
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import people as P
from llmgw.events.schema.envelope import utc_now
from llmgw.services.people import rules


class PeopleService:
    def __init__(
        self,
        store: EventStore,
        *,
        folds: FollowerRegistry | None = None,
        clock: Callable[[], datetime] = utc_now,
        verifier: CommandVerifier | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        # The people and the tree (which resolves the scope a role is granted over): the process's verifier
        # folds exactly these, so with one the service decides on its fold instead of folding them again.
        self.shares_fold = verifier is not None
        if verifier is not None:
            self.folded, self.fold = verifier.folded, verifier.fold_to_decide_on()
        else:
            self.folded = PeopleAndTree()
            self.fold = Followers(store, PeopleAndTree.subjects("people"), self.folded.apply, registry=folds)
        self.people, self.tree = self.folded.people, self.folded.tree
        self.shell = CommandShell(
            store,
            service=P.SERVICE,
            what="the people",
            fold=self.fold,
            state=self.folded,
            decide=rules.decide,
            payload_type=P.PeopleCommand,
            authorize=lambda command, payload: rules.need(command.actor, payload),
            verifier=verifier,
            clock=clock,
        )

    def start(self) -> None:
        """Follow the log from now on (the first command would start it otherwise)."""
        self.fold.start()

    async def close(self) -> None:
        if not self.shares_fold:  # a shared fold stops with the verifier's last user
            await self.fold.close()

    def processor(self) -> CommandProcessor:
        return self.shell.processor()
