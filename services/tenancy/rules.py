"""The tenancy service's state and its one ``decide``: the tree (:mod:`.tree`) and the capacity quotas
(:mod:`.quotas`), which name scopes of the tree, so the service that folds the tree decides them (SCHED-8).

The tree folds the key events too (``llmgw.evt.key.>``), so a project that still holds live keys is
not deleted. A key is created only while the tree is unchanged (the access service fences on it), so a
key for a project deleted meanwhile is refused; a key created between this read and the delete's append
is the one race left, milliseconds wide (docs/decisions.md).
"""

from __future__ import annotations

from datetime import datetime

from llmgw.events.commands.shell import Decision
from llmgw.events.folds import quotas as QF
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import access as A
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of
from llmgw.services.tenancy import quotas, tree

# What the state folds, each subject filter with the name its follower shows on /healthz.
SUBJECTS = {
    tree.SUBJECT: "tenancy",
    f"{EVENTS_ROOT}.{A.KEY_AGGREGATE}.>": "tenancy-keys",
    f"{EVENTS_ROOT}.{Q.AGGREGATE}.>": "tenancy-quotas",
}


class TenancyState:
    """The tree (with each project's live keys) and the quotas, changed only by :meth:`apply`."""

    def __init__(self) -> None:
        self.tree = TenancyTree()
        self.quotas: dict[str, QF.Quota] = {}  # scope id -> its quota

    def apply(self, event: RecordedEvent) -> None:
        if event.subject == tree.SUBJECT:
            self.tree.apply(event)
        elif isinstance(event.payload, Q.QUOTA_EVENTS):
            sid = aggregate_of(event.subject)[1]
            quota = QF.fold_quota(self.quotas.get(sid), event.payload)
            if quota is None:
                self.quotas.pop(sid, None)
            else:
                self.quotas[sid] = quota
        else:
            self.tree.apply_key(event)


def decide(state: TenancyState, command: T.TenancyCommand | Q.QuotaCommand, now: datetime) -> Decision:
    """Pure: a tree or quota command over the state → its :class:`Decision`, or a refusal."""
    if isinstance(command, Q.QuotaCommand):
        return quotas.decide_quota(state.tree, state.quotas, command)
    return tree.decide(state.tree, command)
