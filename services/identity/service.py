"""The identity service: owns the ``idp`` and ``scimgroup`` aggregates and handles `llmgw ctl sso|ldap|scim …`.

Its rules are :mod:`.rules` (pure); :class:`~llmgw.events.commands.shell.FoldedService` does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.shell import FoldedService
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import identity as I
from llmgw.events.schema.envelope import utc_now
from llmgw.services.identity import rules


class IdentityService(FoldedService):
    def __init__(
        self,
        store: EventStore,
        *,
        folds: FollowerRegistry | None = None,
        clock: Callable[[], datetime] = utc_now,
        verifier: CommandVerifier | None = None,
    ) -> None:
        folded = rules.IdentityAndTree()
        super().__init__(
            store,
            service=I.SERVICE,
            what="the identity providers",
            state=folded,
            subjects=rules.IdentityAndTree.subjects("identity"),
            decide=rules.decide,
            payload_type=I.IdentityCommand,
            need=rules.need,
            folds=folds,
            verifier=verifier,
            clock=clock,
        )
        self.identity, self.tree = folded.identity, folded.tree
