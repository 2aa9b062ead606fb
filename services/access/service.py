"""The access service: owns keys, limits, prices and budgets, and handles their commands.

Its rules are :mod:`.rules` (pure); :class:`~llmgw.events.commands.shell.CommandShell` does the rest:
catch the folded state up with the log (the tenancy tree and the ``key``, ``limit``, ``price`` and
``budget`` aggregates), decide, append with the aggregate's expected sequence, and on a conflict
catch up and decide again. A new key is appended fenced on the tenancy tree's sequence, so a key
is never created for a project deleted meanwhile.
"""

from __future__ import annotations

import structlog

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.command import Command
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import CommandShell, Decision, Fence
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import access as A
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import utc_now
from llmgw.events.schema.subjects import EVENTS_ROOT, event_subject
from llmgw.services.access import rules

log = structlog.get_logger("llmgw.services.access")


class AccessService:
    def __init__(
        self, store: EventStore, *, folds: FollowerRegistry | None = None, verifier: CommandVerifier | None = None
    ) -> None:
        self.store = store
        self.state = rules.AccessState()
        self.tree_subject = event_subject(T.AGGREGATE, T.TREE_ID)
        # What the state folds, each subject by a follower of its own (named as /healthz shows it).
        subjects = {
            self.tree_subject: "access-tenancy",
            **{
                f"{EVENTS_ROOT}.{aggregate}.>": f"access-{aggregate}s"
                for aggregate in (A.KEY_AGGREGATE, A.LIMIT_AGGREGATE, A.PRICE_AGGREGATE, A.BUDGET_AGGREGATE)
            },
        }
        self.fold = Followers(store, subjects, lambda event: self.state.apply(event), registry=folds)
        self.shell = CommandShell(
            store,
            service=A.SERVICE,
            what="the access settings",
            fold=self.fold,
            decide=self.decide,
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

    def decide(self, command: Command, payload: A.AccessCommand) -> Decision:
        return self.decision(rules.decide(self.state, payload, utc_now()))

    def decision(self, decided: rules.Decision) -> Decision:
        """The rules' decision as the shell appends it: a new key fenced on the tenancy tree as folded."""
        return Decision(
            subject=decided.subject,
            payloads=decided.payloads,
            expected=self.state.subject_seqs.get(decided.subject, 0),
            # Where the fold has read the tree to (past an event it quarantined too, so one poisoned
            # event does not refuse every later key).
            fence=Fence(self.tree_subject, self.fold.positions[self.tree_subject]) if decided.fence_tree else None,
            message=decided.message,
            result=decided.result,
        )

    def processor(self) -> CommandProcessor:
        return self.shell.processor()
