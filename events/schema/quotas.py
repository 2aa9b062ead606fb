"""Capacity quotas over the tenancy tree (SPEC SCHED-8): a guarantee and a limit per scope.

One aggregate per scope (``llmgw.evt.quota.<scope id>``): ``quota.set`` carries the whole quota, so
any reader folds a scope's quota from its last event alone; ``quota.cleared`` removes it. Scopes are
named by id on the log (a rename keeps the quota) and by path in commands
(docs/decisions.md, "Scopes: ids on the log, paths in commands").

Folding a scope's quota and resolving a scope's name against the tree: :mod:`llmgw.events.folds.quotas`.
"""

from __future__ import annotations

import msgspec

from llmgw.events.schema.registry import EventType

AGGREGATE = "quota"
# Every scheduler instance answers (a queue group): each scope's quota and what it holds now, as JSON.
QUOTAS_SUBJECT = "llmgw.rpc.scheduler.quotas"
KINDS = ("org", "team", "project")


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


QUOTA_EVENTS = (QuotaSet, QuotaCleared)


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
