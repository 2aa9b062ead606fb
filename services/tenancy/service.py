"""The tenancy service: owns the tenancy tree aggregate and handles its commands.

Its rules are :mod:`.tree` (pure); :class:`~llmgw.events.commands.shell.CommandShell` does the rest:
catch the folded tree up with the log, decide, append with the tree's expected sequence, and on a
conflict catch up and decide again. The service also folds
the key events (``llmgw.evt.key.>``), so a project that still holds live keys is not deleted.
"""

from __future__ import annotations

import msgspec
import structlog

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.command import Command
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import CommandShell, Decision
from llmgw.events.folds import quotas as QF
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import access as A
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject
from llmgw.services.tenancy.quotas import decide_quota, need_quota
from llmgw.services.tenancy.tree import TenancyTree, decide, need

log = structlog.get_logger("llmgw.services.tenancy")


class TenancyService:
    def __init__(
        self, store: EventStore, *, folds: FollowerRegistry | None = None, verifier: CommandVerifier | None = None
    ) -> None:
        self.store = store
        self.tree = TenancyTree()
        self.subject = event_subject(T.AGGREGATE, T.TREE_ID)
        self.keys_subject = f"{EVENTS_ROOT}.{A.KEY_AGGREGATE}.>"
        # Capacity quotas name scopes, so the service that folds the tree decides them (SCHED-8).
        self.quotas_subject = f"{EVENTS_ROOT}.{Q.AGGREGATE}.>"
        self.quotas: dict[str, QF.Quota] = {}
        self.quota_seqs: dict[str, int] = {}  # scope id -> last sequence on its quota subject
        # A key is created only while the tree is unchanged (the access service fences on it), so a key
        # for a project deleted meanwhile is refused; a key created between this read and the delete's
        # append is the one race left, milliseconds wide (docs/decisions.md).
        self.fold = Followers(
            store,
            {self.subject: "tenancy", self.keys_subject: "tenancy-keys", self.quotas_subject: "tenancy-quotas"},
            self._apply,
            registry=folds,
        )
        self.shell = CommandShell(
            store,
            service=T.SERVICE,
            what="the tenancy tree",
            fold=self.fold,
            decide=self.decide,
            payload_type=T.TenancyCommand | Q.QuotaCommand,
            authorize=lambda command, payload: (
                need_quota(self.tree, payload) if isinstance(payload, Q.QuotaCommand) else need(payload)
            ),
            verifier=verifier,
        )

    def _apply(self, event: RecordedEvent) -> None:
        if event.subject == self.subject:
            self.tree.apply(event)
        elif isinstance(event.payload, Q.QUOTA_EVENTS):
            sid = aggregate_of(event.subject)[1]
            self.quota_seqs[sid] = event.seq
            quota = QF.fold_quota(self.quotas.get(sid), event.payload)
            if quota is None:
                self.quotas.pop(sid, None)
            else:
                self.quotas[sid] = quota
        else:
            self.tree.apply_key(event)

    def start(self) -> None:
        """Follow the log from now on (the first command would start it otherwise)."""
        self.fold.start()

    async def close(self) -> None:
        await self.fold.close()

    async def catch_up(self) -> None:
        await self.fold.catch_up()

    def decide(self, command: Command, payload: T.TenancyCommand | Q.QuotaCommand) -> Decision:
        if isinstance(payload, Q.QuotaCommand):
            sid, quota_payloads, message = decide_quota(self.tree, self.quotas, payload)
            return Decision(
                subject=event_subject(Q.AGGREGATE, sid),
                payloads=quota_payloads,
                expected=self.quota_seqs.get(sid, 0),
                message=message,
                result={"scope_id": sid},
            )
        payloads = decide(self.tree, payload)
        return Decision(
            subject=self.subject,
            payloads=payloads,
            # Where the fold has read the tree to, past an event it quarantined too: one poisoned
            # event must not leave every later command conflicting with it for good.
            expected=self.fold.positions[self.subject],
            message=describe(payload),
            result={"id": scope_id(payloads[0])},
        )

    def processor(self) -> CommandProcessor:
        return self.shell.processor()


def describe(command: T.TenancyCommand) -> str:
    match command:
        case T.CreateScope():
            return f"{command.kind} {command.path} created"
        case T.RenameScope():
            return f"{command.kind} {command.path} renamed to {command.name}"
        case T.DeleteScope():
            return f"{command.kind} {command.path} deleted"
    return "done"


def scope_id(payload: msgspec.Struct) -> str:
    for field in ("project_id", "team_id", "org_id"):  # most specific first: a team names its org too
        if hasattr(payload, field):
            return getattr(payload, field)
    return ""
