"""A scope's quota folded from its events, and a scope's name resolved against the tenancy tree. Pure.

:func:`resolve_scope` reads ``org:acme``, ``team:acme/ml``, ``project:acme/ml/chat``, a bare path or
a bare name against the tenancy tree, once for the tenancy service (which decides quota commands)
and the scheduler (which resolves a model's owner).
"""

from __future__ import annotations

import msgspec

from llmgw.events.folds.tenancy import Scope, TenancyTree
from llmgw.events.schema.quotas import KINDS, QuotaCleared, QuotaSet, Resources

_DEPTH_KIND = {1: "org", 2: "team", 3: "project"}


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


def fold_quota(quota: Quota | None, payload: msgspec.Struct) -> Quota | None:
    """The scope's quota after one of its events (None: no quota). Pure."""
    match payload:
        case QuotaSet():
            return Quota(scope_id=payload.scope_id, kind=payload.kind, guarantee=payload.guarantee, limit=payload.limit)
        case QuotaCleared():
            return None
    return quota


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
