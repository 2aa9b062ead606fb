"""The tenancy tree folded from its events, once for every reader (SPEC TEN-1).

Organisations hold teams; teams hold projects. The tenancy service (which decides), the access
service (which resolves ``acme/ml/chat`` to a project id) and the routers (which charge a request
to its key's project, team and org) all need the tree; the routers used to keep their own map of
parents. :class:`TenancyTree` is the one fold, with the queries over it; the tenancy service's
rules (``services/tenancy/tree.py``) decide against it.

The tree also folds ``key.created`` and ``key.revoked`` (:meth:`TenancyTree.apply_key`, through
the shared key fold) into each project's live keys, so a project that still holds keys is not
deleted. Key events live on their own subjects and never move :attr:`TenancyTree.last_seq`, the
tree's expected sequence.
"""

from __future__ import annotations

import msgspec

from llmgw.events.folds import keys as K
from llmgw.events.schema import access as A
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent

TREE_EVENTS = tuple(t.struct for t in T.EVENTS)  # what :meth:`TenancyTree.apply` folds


class Scope(msgspec.Struct, kw_only=True):
    id: str
    kind: str
    name: str
    parent_id: str | None = None


class TenancyTree:
    """Mutable, but changed only by :meth:`apply`, so the same events always give the same tree."""

    def __init__(self) -> None:
        self.scopes: dict[str, Scope] = {}
        self.placed: dict[str, tuple[str, str | None]] = {}  # every scope ever created -> (kind, parent id)
        self.last_seq = 0
        self.keys: dict[str, K.Key] = {}  # by id, as the shared fold (events/folds/keys.py) keeps them
        self.live_keys: dict[str, dict[str, str]] = {}  # project id -> {key id: name (or id)}
        self.keys_seq = 0  # position in the key events folded so far

    # -- fold --------------------------------------------------------------------------------

    def apply(self, event: RecordedEvent) -> None:
        p = event.payload
        match p:
            case T.OrgCreated():
                self._place(Scope(id=p.org_id, kind="org", name=p.name))
            case T.TeamCreated():
                self._place(Scope(id=p.team_id, kind="team", name=p.name, parent_id=p.org_id))
            case T.ProjectCreated():
                self._place(Scope(id=p.project_id, kind="project", name=p.name, parent_id=p.team_id))
            case T.OrgRenamed(org_id=sid) | T.TeamRenamed(team_id=sid) | T.ProjectRenamed(project_id=sid):
                if sid in self.scopes:
                    self.scopes[sid].name = p.name
            case T.OrgDeleted(org_id=sid) | T.TeamDeleted(team_id=sid) | T.ProjectDeleted(project_id=sid):
                self.scopes.pop(sid, None)
        self.last_seq = max(self.last_seq, event.seq)

    def _place(self, scope: Scope) -> None:
        self.scopes[scope.id] = scope
        self.placed[scope.id] = (scope.kind, scope.parent_id)

    def apply_key(self, event: RecordedEvent) -> None:
        """Fold a key event into its project's live keys (other events only move :attr:`keys_seq`)."""
        p = event.payload
        if isinstance(p, A.KeyCreated | A.KeyRevoked):
            key = K.fold_key(self.keys.get(p.key_id), p)
            if key is not None:
                self.keys[key.id] = key
                live = self.live_keys.setdefault(key.project_id, {})
                if key.revoked:
                    live.pop(key.id, None)
                else:
                    live[key.id] = key.name or key.id
                if not live:
                    del self.live_keys[key.project_id]
        self.keys_seq = max(self.keys_seq, event.seq)

    # -- queries -----------------------------------------------------------------------------

    def children(self, scope_id: str | None) -> list[Scope]:
        return sorted((s for s in self.scopes.values() if s.parent_id == scope_id), key=lambda s: s.name)

    def path(self, scope: Scope) -> str:
        parts = [scope.name]
        parent = scope.parent_id
        while parent is not None:
            ps = self.scopes[parent]
            parts.append(ps.name)
            parent = ps.parent_id
        return "/".join(reversed(parts))

    def find(self, kind: str, path: str) -> Scope | None:
        """The scope of ``kind`` at ``path``, or by id."""
        by_id = self.scopes.get(path)
        if by_id is not None and by_id.kind == kind:
            return by_id
        parent: str | None = None
        found: Scope | None = None
        for name in path.split("/"):
            found = next((s for s in self.children(parent) if s.name == name), None)
            if found is None:
                return None
            parent = found.id
        return found if found is not None and found.kind == kind else None

    def chain(self, kind: str, tenant: str) -> tuple[list[str], str]:
        """The scopes a tenant (``kind`` and a path or id) sits in, nearest first, ending in ``cluster``,
        and its name as a person reads it (``team:acme/ml``). An unknown tenant sits in the cluster
        only, so only a role over the whole cluster reaches it (and learns that it is unknown)."""
        if kind == "cluster":
            return ["cluster"], "cluster"
        found = self.find(kind, tenant)
        if found is None:
            return ["cluster"], f"{kind}:{tenant}"
        return [f"{kind}:{found.id}", *self.scopes_above(found.id), "cluster"], f"{kind}:{self.path(found)}"

    def label(self, scope: str) -> str:
        """A scope as on the log (``team:<id>``) as a person reads it (``team:acme/ml``)."""
        kind, _, sid = scope.partition(":")
        found = self.scopes.get(sid)
        return f"{kind}:{self.path(found)}" if found is not None else scope

    def scopes_above(self, scope_id: str) -> list[str]:
        """The scopes above ``scope_id`` as on the log, nearest first (``team:<id>``, ``org:<id>``).

        Deleted scopes keep their place: ids are never reused and a scope never moves, so a key made
        for a project deleted meanwhile (the one race left) is still held to its team's and org's
        limits and budgets.
        """
        out: list[str] = []
        place = self.placed.get(scope_id)
        while place is not None and place[1] is not None and len(out) < 2:  # org ← team ← project
            parent = place[1]
            place = self.placed.get(parent)
            if place is None:
                break
            out.append(f"{place[0]}:{parent}")
        return out
