"""Roles over the tenancy tree (issue "Trust", item 2): who may do what where, as a pure rule.

A person holds roles, each bound to a scope: the cluster, an org, a team or a project. A role
bound to a scope covers everything under it (an org's teams and projects), and a higher role
includes the lower ones (a team admin may do what a member and a viewer may):

    viewer < member < team-admin < org-admin < cluster-admin

docs/people.md has the table of what each may do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

CLUSTER = "cluster"
RANKS = {"viewer": 1, "member": 2, "team-admin": 3, "org-admin": 4, "cluster-admin": 5}
ROLES = tuple(RANKS)
# Where each role may be bound: an org admin to an org, a member to any tenant…
BINDABLE = {
    "cluster-admin": ("cluster",),
    "org-admin": ("org",),
    "team-admin": ("team",),
    "member": ("org", "team", "project"),
    "viewer": ("cluster", "org", "team", "project"),
}


def kind_of(scope: str) -> str:
    return CLUSTER if scope == CLUSTER else scope.partition(":")[0]


def allows(bindings: Iterable[tuple[str, str]], need: str, chain: Iterable[str]) -> bool:
    """Whether a person with ``bindings`` (role, scope) may act as ``need`` on something whose scope,
    with those above it, is ``chain`` (nearest first, e.g. ``project:p``, ``team:t``, ``org:o``,
    ``cluster``)."""
    above = set(chain) | {CLUSTER}
    return any(RANKS.get(role, 0) >= RANKS[need] and scope in above for role, scope in bindings)


def needs(need: str, scope_label: str) -> str:
    """What a refusal says is needed: ``member of team:acme/ml``, ``viewer of the cluster``."""
    return f"{need} of the cluster" if scope_label == CLUSTER else f"{need} of {scope_label}"


def refusal(
    who: str,
    bindings: list[tuple[str, str]],
    need: str,
    chain: list[str],
    scope_label: str,
    what: str,
    label: Callable[[str], str],
) -> str | None:
    """None when ``bindings`` allow ``need`` within ``chain``; else the refusal a person reads:
    "creating a key needs member of project:acme/ml/chat; bob holds viewer of the cluster"."""
    if allows(bindings, need, chain):
        return None
    held = ", ".join(needs(role, label(scope)) for role, scope in bindings) or "no role"
    return f"{what} needs {needs(need, scope_label)}; {who} holds {held}"


class Need(msgspec.Struct, frozen=True, kw_only=True):
    """What a command asks of the person who sends it: a role over a scope.

    ``kind`` is ``cluster`` or the kind of tenant (``org``, ``team``, ``project``) the command acts
    on, ``tenant`` that tenant's path or id; ``what`` says what the command does, for the refusal
    ("creating a key in acme/ml/chat needs member of project:acme/ml/chat").
    """

    role: str
    what: str
    kind: str = CLUSTER
    tenant: str = ""


def cluster_admin(what: str) -> Need:
    return Need(role="cluster-admin", what=what)
