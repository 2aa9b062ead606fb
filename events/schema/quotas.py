"""Capacity quotas over the tenancy tree (SPEC SCHED-8): a guarantee and a limit per scope.

One aggregate per scope (``llmgw.evt.quota.<scope id>``): ``quota.set`` carries the whole quota, so
any reader folds a scope's quota from its last event alone; ``quota.cleared`` removes it. Scopes are
named by id on the log (a rename keeps the quota) and by path in commands
(docs/decisions.md, "Scopes: ids on the log, paths in commands").

:func:`resolve_scope` reads ``org:acme``, ``team:acme/ml``, ``project:acme/ml/chat``, a bare path or
a bare name against the tenancy tree, once for the tenancy service (which decides quota commands)
and the scheduler (which resolves a model's owner).
"""

from __future__ import annotations

import msgspec

from llmgw.events.folds.tenancy import Scope, TenancyTree
from llmgw.events.schema.registry import EventType

AGGREGATE = "quota"
# Every scheduler instance answers (a queue group): each scope's quota and what it holds now, as JSON.
QUOTAS_SUBJECT = "llmgw.rpc.scheduler.quotas"
KINDS = ("org", "team", "project")
_DEPTH_KIND = {1: "org", 2: "team", 3: "project"}


class Resources(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An amount of capacity; None leaves a resource unset (no guarantee of it, no limit on it)."""

    gpus: int | None = None
    cores: int | None = None
    memory_bytes: int | None = None

    def is_empty(self) -> bool:
        return self.gpus is None and self.cores is None and self.memory_bytes is None


RESOURCES = ("gpus", "cores", "memory_bytes")


class QuotaSet(msgspec.Struct, frozen=True, kw_only=True):
    scope_id: str
    kind: str  # org, team or project
    path: str = ""  # as it was named when set (for people reading the log; the id is what counts)
    guarantee: Resources = Resources()
    limit: Resources = Resources()


class QuotaCleared(msgspec.Struct, frozen=True, kw_only=True):
    scope_id: str
    kind: str
    path: str = ""


class Quota(msgspec.Struct, frozen=True, kw_only=True):
    """A scope's quota as every reader folds it."""

    scope_id: str
    kind: str
    guarantee: Resources = Resources()
    limit: Resources = Resources()

    @property
    def scope(self) -> str:
        """As on the log: ``team:<id>``."""
        return f"{self.kind}:{self.scope_id}"


QUOTA_EVENTS = (QuotaSet, QuotaCleared)


def fold_quota(quota: Quota | None, payload: msgspec.Struct) -> Quota | None:
    """The scope's quota after one of its events (None: no quota). Pure."""
    match payload:
        case QuotaSet():
            return Quota(scope_id=payload.scope_id, kind=payload.kind, guarantee=payload.guarantee, limit=payload.limit)
        case QuotaCleared():
            return None
    return quota


EVENTS = (
    EventType(
        "quota.set",
        1,
        QuotaSet,
        "A scope's capacity quota: what it is guaranteed and what it may not exceed (GPUs, cores, memory).",
    ),
    EventType("quota.cleared", 1, QuotaCleared, "A scope's capacity quota was removed: no guarantee, no limit."),
)


# -- scopes as people name them ------------------------------------------------------------------


class ScopeNotFound(ValueError):
    """No scope by that name: the message says what exists."""


class AmbiguousScope(ScopeNotFound):
    """A bare name several scopes carry: the message names them."""


def resolve_scope(tree: TenancyTree, text: str) -> Scope:
    """The scope ``text`` names: ``org:acme``, ``team:acme/ml``, ``project:acme/ml/chat``, a bare path
    (its depth says its kind), an id, or a bare name that only one team or project carries.

    Raises :class:`ScopeNotFound` naming the choices when a bare name is ambiguous, or what exists
    when nothing matches."""
    text = text.strip()
    kind, sep, path = text.partition(":")
    if sep:
        if kind not in KINDS:
            raise ScopeNotFound(f"scope {text!r}: {kind!r} is not org, team or project (e.g. team:acme/ml)")
        found = tree.find(kind, path)
        if found is None:
            raise ScopeNotFound(f"there is no {kind} {path!r}{_known(tree, kind)}")
        return found
    by_id = tree.scopes.get(text)
    if by_id is not None:
        return by_id
    depth_kind = _DEPTH_KIND.get(len(text.split("/")))
    if depth_kind is not None:
        found = tree.find(depth_kind, text)
        if found is not None:
            return found
    if "/" not in text:
        named = sorted((s for s in tree.scopes.values() if s.name == text), key=lambda s: (s.kind, tree.path(s)))
        if len(named) == 1:
            return named[0]
        if len(named) > 1:
            choices = ", ".join(f"{s.kind}:{tree.path(s)}" for s in named)
            first = choices.split(", ")[0]
            raise AmbiguousScope(f"{text!r} names {len(named)} scopes ({choices}): say which, e.g. {first}")
    raise ScopeNotFound(f"there is no scope {text!r}{_known(tree, depth_kind or 'org')}")


def _known(tree: TenancyTree, kind: str) -> str:
    listing = ", ".join(sorted(tree.path(s) for s in tree.scopes.values() if s.kind == kind))
    return f" ({kind}s: {listing})" if listing and len(listing) < 300 else ""


def owner_shape_error(owner: str) -> str | None:
    """Why ``owner`` cannot name a scope at all (the catalog checks the shape; the scheduler, which
    folds the tree, reports an owner that names no scope); None when it may."""
    kind, sep, path = owner.partition(":")
    if not sep:
        path = owner
    elif kind not in KINDS:
        return f"owner {owner!r}: {kind!r} is not org, team or project (e.g. team:acme/ml)"
    parts = path.split("/")
    if len(parts) > 3:
        return f"owner {owner!r} has {len(parts)} parts: an owner is org, org/team or org/team/project"
    if not all(parts) or any(p.strip() != p for p in parts):
        return f"owner {owner!r} has an empty or padded part: write it like acme/ml"
    return None


# -- commands (the tenancy service's: it folds the tree they are resolved against) ---------------


class SetQuota(msgspec.Struct, frozen=True, kw_only=True, tag="quota_set", forbid_unknown_fields=True):
    scope: str  # org:acme, team:acme/ml, project:acme/ml/chat, or a bare path or name
    guarantee: Resources = Resources()
    limit: Resources = Resources()


class ClearQuota(msgspec.Struct, frozen=True, kw_only=True, tag="quota_clear", forbid_unknown_fields=True):
    scope: str


QuotaCommand = SetQuota | ClearQuota
