"""The tenancy service: owns the tenancy tree aggregate and the capacity quotas, and handles their commands.

Its state and rules are :mod:`.rules` (pure: the tree's in :mod:`.tree`, the quotas' in :mod:`.quotas`);
:class:`~llmgw.events.commands.shell.CommandShell` does the rest: catch the folded state up with the
log, decide, append with the aggregate's expected sequence, and on a conflict catch up and decide again.
"""

from __future__ import annotations

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import CommandShell
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import tenancy as T
from llmgw.services.tenancy import rules
from llmgw.services.tenancy.quotas import need_quota
from llmgw.services.tenancy.tree import need


class TenancyService:
    def __init__(
        self, store: EventStore, *, folds: FollowerRegistry | None = None, verifier: CommandVerifier | None = None
    ) -> None:
        self.store = store
        self.state = rules.TenancyState()
        self.tree = self.state.tree
        self.fold = Followers(store, rules.SUBJECTS, self.state.apply, registry=folds)
        self.shell = CommandShell(
            store,
            service=T.SERVICE,
            what="the tenancy tree",
            fold=self.fold,
            state=self.state,
            decide=rules.decide,
            payload_type=T.TenancyCommand | Q.QuotaCommand,
            authorize=lambda command, payload: (
                need_quota(self.tree, payload) if isinstance(payload, Q.QuotaCommand) else need(payload)
            ),
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
