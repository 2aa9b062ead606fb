"""Quota commands (SPEC SCHED-8): pure decisions over the tenancy tree and the folded quotas.

The tenancy service decides them because a quota names a scope, and the service already folds the
tree the scope is resolved against (docs/decisions.md, "Quotas are the tenancy service's").
"""

from __future__ import annotations

import msgspec

from llmgw.events.commands import roles as R
from llmgw.events.commands.shell import Decision
from llmgw.events.folds import quotas as QF
from llmgw.events.folds.tenancy import Scope, TenancyTree
from llmgw.events.schema import quotas as Q
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject


def _scope(tree: TenancyTree, text: str) -> Scope:
    try:
        return QF.resolve_scope(tree, text)
    except QF.ScopeNotFound as exc:
        code = "ambiguous" if isinstance(exc, QF.AmbiguousScope) else "not_found"
        raise Rejected(str(exc), code) from exc


def _check(what: str, r: Q.Resources) -> None:
    for name in Q.RESOURCES:
        v = getattr(r, name)
        if v is not None and v < 0:
            raise Rejected(f"{what} {name.replace('_bytes', '')} {v} is negative", "invalid_quota")


def decide_quota(tree: TenancyTree, quotas: dict[str, QF.Quota], command: Q.QuotaCommand) -> Decision:
    """The scope's quota events for a quota command (on the scope's quota subject), or a refusal."""
    scope = _scope(tree, command.scope)
    label = f"{scope.kind}:{tree.path(scope)}"

    def decision(payloads: list[msgspec.Struct], message: str) -> Decision:
        subject = event_subject(Q.AGGREGATE, scope.id)
        return Decision(subject=subject, payloads=payloads, message=message, result={"scope_id": scope.id})

    match command:
        case Q.SetQuota(guarantee=g, limit=lim):
            if g.is_empty() and lim.is_empty():
                raise Rejected(
                    "say what to set: --gpus/--cores/--memory (the guarantee) and/or --limit-gpus/--limit-cores/"
                    f"--limit-memory (the limit); `llmgw ctl quota clear {label}` removes a quota",
                    "invalid_quota",
                )
            _check("guarantee", g)
            _check("limit", lim)
            for name in Q.RESOURCES:
                lo, hi = getattr(g, name), getattr(lim, name)
                if lo is not None and hi is not None and lo > hi:
                    shown = name.replace("_bytes", "")
                    raise Rejected(
                        f"{label}: the guarantee of {shown} ({lo}) is above its limit ({hi}); a scope cannot be "
                        "promised more than it may hold",
                        "invalid_quota",
                    )
            old = quotas.get(scope.id)
            if old is not None and old.guarantee == g and old.limit == lim:
                return decision([], f"{label} already has this quota")
            payload = Q.QuotaSet(scope_id=scope.id, kind=scope.kind, path=tree.path(scope), guarantee=g, limit=lim)
            return decision([payload], f"quota of {label} set")
        case Q.ClearQuota():
            if scope.id not in quotas:
                return decision([], f"{label} has no quota")
            cleared = Q.QuotaCleared(scope_id=scope.id, kind=scope.kind, path=tree.path(scope))
            return decision([cleared], f"quota of {label} cleared")
    raise Rejected(f"unknown quota command {type(command).__name__}")


def need_quota(tree: TenancyTree, command: Q.QuotaCommand) -> R.Need:
    """Who may set or clear a quota (pure): a cluster admin for an org (an org's admins must not raise
    their own limit); for a team or a project, its org's admins too."""
    verb = "setting" if isinstance(command, Q.SetQuota) else "clearing"
    what = f"{verb} the quota of {command.scope}"
    try:
        scope = QF.resolve_scope(tree, command.scope)
    except QF.ScopeNotFound:
        return R.cluster_admin(what)  # the decision then says what is wrong with the name
    if scope.kind == "org":
        return R.cluster_admin(what)
    return R.Need(role="org-admin", what=what, kind=scope.kind, tenant=scope.id)
