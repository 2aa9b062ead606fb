"""Capacity quotas over the tenancy tree (SPEC SCHED-8): holdings, limits, guarantees. Pure.

A model's ``owner`` (``acme``, ``acme/ml``, ``team:acme/ml``…) names the scope its replicas use the
capacity of. A scope **holds** what the active and draining replicas of every model owned by it or
by a scope below it reserve (GPUs, cores, memory), summed up the tree: a team's replicas count for
its org too. A scope's **limit** is what it may not exceed: the pass places no replica that would
take any scope on its owner's chain over a limit (:func:`limit_block`). A scope's **guarantee** is
what it may keep whatever others want: a replica within its owner's (or an ancestor's) guarantee is
*protected* and must never be taken for another scope; an owned replica beyond every guarantee is
*borrowed* and is taken back first (:func:`protected_replicas`, :func:`borrowed_replicas`, for
preemption). A model without an owner, or whose owner names no scope, is held to no quota.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec

from llmgw.events.folds import quotas as QF
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import replicas as R
from llmgw.services.scheduler.placement import Need
from llmgw.services.scheduler.state import ClusterState, ReplicaState

GiB = 1024**3


class Usage(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    gpus: int = 0
    cores: int = 0
    memory_bytes: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            gpus=self.gpus + other.gpus,
            cores=self.cores + other.cores,
            memory_bytes=self.memory_bytes + other.memory_bytes,
        )


ZERO = Usage()


def usage_of(r: ReplicaState) -> Usage:
    return Usage(gpus=len(r.gpus), cores=r.cores, memory_bytes=r.memory_bytes)


def usage_of_need(need: Need) -> Usage:
    return Usage(gpus=need.gpus, cores=need.cores, memory_bytes=need.memory_bytes)


HOLDING = frozenset((*R.ACTIVE, "draining"))  # the states whose reservation counts


def holds(r: ReplicaState) -> bool:
    """Whether a replica's reservation counts: placed, starting, ready or draining."""
    return r.state in HOLDING


# -- owners ----------------------------------------------------------------------------------------


def owner_chain(state: ClusterState, owner: str | None) -> list[str]:
    """The scopes a model with ``owner`` uses the capacity of, as on the log, nearest first
    (``team:<id>``, ``org:<id>``); empty when it has no owner or its owner names no scope."""
    if not owner:
        return []
    try:
        scope = QF.resolve_scope(state.tree, owner)
    except QF.ScopeNotFound:
        return []
    return [f"{scope.kind}:{scope.id}", *state.tree.scopes_above(scope.id)]


def owner_problem(state: ClusterState, owner: str | None) -> str | None:
    """Why a model's owner counts against no quota (it names no scope, or several); None when it does."""
    if not owner:
        return None
    try:
        QF.resolve_scope(state.tree, owner)
    except QF.ScopeNotFound as exc:
        return f"owner {owner!r} is held to no quota: {exc}"
    return None


def chains(state: ClusterState) -> dict[str, list[str]]:
    """Model name → its owner's chain, for every model whose owner names a scope (kept by the state
    until an owner, scope or quota changes: read it, never change it)."""
    return state.derived("quota.chains", _chains, ("chains", state.scopes_version, state.owners_version))


def _chains(state: ClusterState) -> dict[str, list[str]]:
    cache: dict[str, list[str]] = {}
    out: dict[str, list[str]] = {}
    for name, m in state.models.items():
        owner = m.spec.owner
        if not owner:
            continue
        chain = cache.get(owner)
        if chain is None:
            chain = cache[owner] = owner_chain(state, owner)
        if chain:
            out[name] = chain
    return out


def quotas_by_scope(state: ClusterState) -> dict[str, QF.Quota]:
    """Quotas keyed as chains name scopes (``team:<id>``)."""
    return {q.scope: q for q in state.quotas.values()}


def holdings(state: ClusterState) -> dict[str, Usage]:
    """Scope (``team:<id>``) → what the replicas of models it (or a scope below it) owns reserve now
    (kept by the state until a replica, owner or scope changes: read it, never change it)."""
    return state.derived("quota.holdings", _holdings)


def _holdings(state: ClusterState) -> dict[str, Usage]:
    model_chains = chains(state)
    out: dict[str, Usage] = {}
    for model, chain in model_chains.items():
        gpus = cores = memory = 0  # plain sums: a pass pays this once, over every replica (docs/benchmarks.md)
        for r in state.replicas_of(model):
            if r.state in HOLDING:
                gpus += len(r.gpus)
                cores += r.cores
                memory += r.memory_bytes
        if not (gpus or cores or memory):
            continue
        total = Usage(gpus=gpus, cores=cores, memory_bytes=memory)
        for scope in chain:
            held = out.get(scope)
            out[scope] = total if held is None else held + total
    return out


# -- limits --------------------------------------------------------------------------------------------


def _amount(resource: str, n: int) -> str:
    if resource == "gpus":
        return f"{n} GPU" + ("" if n == 1 else "s")
    if resource == "cores":
        return f"{n} core" + ("" if n == 1 else "s")
    return f"{n / GiB:.4g} GB of memory"


def limit_block(
    chain: list[str],
    held: dict[str, Usage],
    need: Usage,
    quotas: dict[str, QF.Quota],
    label: Callable[[str], str],
) -> str | None:
    """The sentence for a replica reserving ``need`` that would take a scope on ``chain`` over its
    limit ("org:acme is at its capacity limit (16 GPUs of 16; a replica needs 2 more)"), nearest
    scope first; None when it fits every limit. A resource the replica does not use never blocks it,
    even in a scope already over its limit (lowered since)."""
    for scope in chain:
        q = quotas.get(scope)
        if q is None:
            continue
        h = held.get(scope, ZERO)
        for resource in Q.RESOURCES:
            cap = getattr(q.limit, resource)
            want = getattr(need, resource)
            if cap is None or want <= 0:
                continue
            have = getattr(h, resource)
            if have + want > cap:
                return (
                    f"{label(scope)} is at its capacity limit ({_amount(resource, have)} of {_amount(resource, cap)}"
                    f" held; a replica needs {_amount(resource, want)} more)"
                )
    return None


_BLOCK = re.compile(r"^(\S+) is at its capacity limit \((.*)\)$")


def stopped_at(reason: str) -> str | None:
    """A :func:`limit_block` sentence as headroom says it ("stopped at org:acme's capacity limit (…)");
    None for any other reason."""
    found = _BLOCK.match(reason)
    return f"stopped at {found.group(1)}'s capacity limit ({found.group(2)})" if found else None


class Ledger:
    """What one pass has placed so far, per scope, on top of what the scopes held when it began: each
    placement is checked against every limit on its owner's chain, then counted (so one pass never
    takes a scope over its limit, however many replicas it places)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        every = quotas_by_scope(state)
        self.quotas = {s: q for s, q in every.items() if not q.limit.is_empty()}
        self.guarantees = {s: q.guarantee for s, q in every.items() if not q.guarantee.is_empty()}
        self.chains: dict[str, list[str]] = {}
        self.held: dict[str, Usage] = {}
        if every:
            self.chains = chains(state)
            self.held = dict(holdings(state))  # this pass's placements are added to its own copy

    def guarantee_room(self, model: str, need: Need) -> str | None:
        """:func:`guarantee_room` over this pass's holdings (what it placed so far counted), without
        summing every replica again: the scope, as a person reads it, or None."""
        use = (need.gpus, need.cores, need.memory_bytes)
        for scope in self.chains.get(model, ()):
            g = self.guarantees.get(scope)
            if g is None:
                continue
            h = self.held.get(scope, ZERO)
            if _within([h.gpus, h.cores, h.memory_bytes], (g.gpus, g.cores, g.memory_bytes), use):
                return self.state.tree.label(scope)
        return None

    def block_all(self, model: str, needs: list[Need]) -> str | None:
        """Why no profile of ``model`` may place another replica under its owner's limits (the first
        profile's reason), checked before placement (and preemption) is tried; None when one may."""
        if not self.quotas or not (chain := self.chains.get(model)):
            return None
        reasons = [limit_block(chain, self.held, usage_of_need(n), self.quotas, self.state.tree.label) for n in needs]
        return reasons[0] if reasons and all(reasons) else None

    def admit(self, model: str, need: Need) -> str | None:
        """None, and the replica counted, when it fits every limit on its owner's chain; else why not."""
        if not self.quotas:
            return None
        chain = self.chains.get(model)
        if not chain:
            return None
        use = usage_of_need(need)
        reason = limit_block(chain, self.held, use, self.quotas, self.state.tree.label)
        if reason is None:
            for scope in chain:
                self.held[scope] = self.held.get(scope, ZERO) + use
        return reason


# -- guarantees ------------------------------------------------------------------------------------


def _within(total: list[int], guarantee: tuple[int | None, ...], use: tuple[int, ...]) -> bool:
    """Whether a replica using ``use`` fits what is left of ``guarantee`` after ``total`` (each as
    (gpus, cores, memory_bytes)): within every resource the guarantee sets, and using one of them (a
    GPU guarantee covers GPU replicas, whatever cores and memory they reserve, and no CPU-only replica)."""
    covers = False
    for g, t, want in zip(guarantee, total, use, strict=True):
        if g is None:
            continue
        if t + want > g:
            return False
        covers = covers or want > 0
    return covers


def guarantee_shares(state: ClusterState) -> tuple[dict[str, str], frozenset[str]]:
    """(protected replica id → "within org:acme's guarantee", borrowed replica ids), for every owned
    replica that holds capacity: what :class:`Shares` says of each. Read it, never change it."""
    return state.derived("quota.guarantee_shares", _guarantee_shares)


def _guarantee_shares(state: ClusterState) -> tuple[dict[str, str], frozenset[str]]:
    shares = Shares(state)
    protected: dict[str, str] = {}
    borrowed: set[str] = set()
    for model in chains(state):
        for r in state.replicas_of(model):
            if r.state in HOLDING:
                why, lent = shares.share(r)
                if why:
                    protected[r.id] = why
                elif lent:
                    borrowed.add(r.id)
    return protected, frozenset(borrowed)


class Shares:
    """Which owned replicas are within a guarantee (protected: never taken for another scope) and which
    are borrowed (taken back first), asked replica by replica (preemption asks only of the replicas on
    the nodes it weighs).

    Each scope with a guarantee covers the replicas under it in a stable order — ready before not yet
    ready, oldest first — while they fit what it guarantees; a replica is protected by the nearest
    scope on its owner's chain that covers it. A scope's cover depends on its guarantee and on the
    replicas of the models under it alone, so the state keeps each scope's cover until a scope, a
    quota or one of those models changes: after a replica comes or goes, only the scopes above it
    are covered again."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.chains = chains(state)
        self.guarantees = {
            s: (q.guarantee.gpus, q.guarantee.cores, q.guarantee.memory_bytes)
            for s, q in quotas_by_scope(state).items()
            if not q.guarantee.is_empty()
        }
        self._under: dict[str, list[str]] | None = None
        self._covered: dict[str, frozenset[str]] = {}

    def protection(self, r: ReplicaState) -> str:
        """ "within org:acme's guarantee" for a protected replica; "" for a borrowed or unowned one."""
        for scope in self.chains.get(r.model, ()):
            if scope in self.guarantees and r.id in self.covered(scope):
                return f"within {self.state.tree.label(scope)}'s guarantee"
        return ""

    def share(self, r: ReplicaState) -> tuple[str, bool]:
        """(:meth:`protection`, borrowed): an owned replica holding capacity beyond every guarantee on its
        owner's chain is borrowed."""
        why = self.protection(r)
        return why, not why and r.model in self.chains and r.state in HOLDING

    def covered(self, scope: str) -> frozenset[str]:
        """The replicas ``scope``'s guarantee covers (kept by the state while they may not change)."""
        found = self._covered.get(scope)
        if found is not None:
            return found
        if self._under is None:
            self._under = models_under(self.state)
        models = self._under.get(scope, [])
        versions = self.state.model_versions
        version = (self.state.scopes_version, tuple((m, versions.get(m, 0)) for m in models))
        guarantee = self.guarantees[scope]
        found = self._covered[scope] = self.state.derived(
            f"quota.covered:{scope}", lambda st: _cover(st, guarantee, models), version
        )
        return found


def models_under(state: ClusterState) -> dict[str, list[str]]:
    """Scope → the models owned by it or a scope below it (the inverse of :func:`chains`)."""

    def build(st: ClusterState) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for model, chain in chains(st).items():
            for scope in chain:
                out.setdefault(scope, []).append(model)
        return out

    return state.derived("quota.models_under", build, ("models_under", state.scopes_version, state.owners_version))


def _cover(state: ClusterState, guarantee: tuple[int | None, ...], models: list[str]) -> frozenset[str]:
    rows = sorted(
        (r.state != "ready", r.placed_at, r.id, len(r.gpus), r.cores, r.memory_bytes)
        for model in models
        for r in state.replicas_of(model)
        if r.state in HOLDING
    )
    total = [0, 0, 0]
    out = []
    for _, _, rid, gpus, cores, memory in rows:
        if _within(total, guarantee, (gpus, cores, memory)):
            total[0] += gpus
            total[1] += cores
            total[2] += memory
            out.append(rid)
    return frozenset(out)


def guarantee_room(state: ClusterState, model: str, need: Need) -> str | None:
    """The scope (as a person reads it) within whose guarantee one more replica of ``model`` needing
    ``need`` still fits — capacity it may take back from borrowers (SCHED-8) — or None. Used by
    preemption (services/scheduler/preemption.py, ``Winner.reclaims``)."""
    m = state.models.get(model)
    chain = owner_chain(state, m.spec.owner if m else None)
    if not chain:
        return None
    quotas = quotas_by_scope(state)
    held = holdings(state)
    use = (need.gpus, need.cores, need.memory_bytes)
    for scope in chain:
        q = quotas.get(scope)
        if q is None or q.guarantee.is_empty():
            continue
        h = held.get(scope, ZERO)
        g = (q.guarantee.gpus, q.guarantee.cores, q.guarantee.memory_bytes)
        if _within([h.gpus, h.cores, h.memory_bytes], g, use):
            return state.tree.label(scope)
    return None


def guarantee_words(state: ClusterState, model: str) -> frozenset[str]:
    """The "within …'s guarantee" sentences of the scopes on ``model``'s owner chain: a replica its own
    scope's guarantee protects may still give way to that scope's models (preemption's ``Winner``)."""
    m = state.models.get(model)
    chain = owner_chain(state, m.spec.owner if m else None)
    return frozenset(f"within {state.tree.label(scope)}'s guarantee" for scope in chain)


def protected_replicas(state: ClusterState) -> dict[str, str]:
    """Replica id → why it may not be taken for another scope ("within org:acme's guarantee")."""
    return guarantee_shares(state)[0]


def borrowed_replicas(state: ClusterState) -> frozenset[str]:
    """Owned replicas beyond every guarantee on their owner's chain: taken back first."""
    return guarantee_shares(state)[1]


# -- the view `ctl quota list` shows -------------------------------------------------------------------


def _shown(r: Q.Resources | Usage) -> dict[str, float | int | None]:
    mem = r.memory_bytes
    return {"gpus": r.gpus, "cores": r.cores, "memory_gb": None if mem is None else round(mem / GiB, 2)}


def quota_view(state: ClusterState) -> dict[str, object]:
    """Every scope with a quota or holdings: its guarantee, limit, what it holds, and its replicas'
    shares (protected, borrowed); models whose owner counts against nothing, and why."""
    model_chains = chains(state)
    held = holdings(state)
    quotas = quotas_by_scope(state)
    protected, borrowed = guarantee_shares(state)
    per_scope_p: dict[str, int] = {}
    per_scope_b: dict[str, int] = {}
    for model, chain in model_chains.items():
        for r in state.replicas_of(model):
            for scope in chain:
                if r.id in protected:
                    per_scope_p[scope] = per_scope_p.get(scope, 0) + 1
                elif r.id in borrowed:
                    per_scope_b[scope] = per_scope_b.get(scope, 0) + 1
    rows = []
    for scope in sorted(set(quotas) | set(held), key=state.tree.label):
        q = quotas.get(scope)
        rows.append(
            {
                "scope": state.tree.label(scope),
                "scope_id": scope.partition(":")[2],
                "guarantee": _shown(q.guarantee) if q else None,
                "limit": _shown(q.limit) if q else None,
                "holds": _shown(held.get(scope, ZERO)),
                "protected_replicas": per_scope_p.get(scope, 0),
                "borrowed_replicas": per_scope_b.get(scope, 0),
            }
        )
    unowned = {
        name: why for name, m in sorted(state.models.items()) if (why := owner_problem(state, m.spec.owner)) is not None
    }
    return {"scopes": rows, "unresolved_owners": unowned}


CAPACITY_SERIES = {
    "llmgw_capacity_holds": "What a scope's models (and those of the scopes below it) reserve now",
    "llmgw_capacity_guarantee": "What a scope is guaranteed (set resources only)",
    "llmgw_capacity_limit": "What a scope may not exceed (set resources only)",
}


def capacity_samples(state: ClusterState) -> list[tuple[str, tuple[str, str], float]]:
    """(series, (scope, resource), value) for every scope with a quota, as a person names the scope
    (``team:acme/ml``); resource is ``gpus``, ``cores`` or ``memory_bytes``. Pure."""
    held = holdings(state)
    out: list[tuple[str, tuple[str, str], float]] = []
    for scope, q in sorted(quotas_by_scope(state).items()):
        label = state.tree.label(scope)
        h = held.get(scope, ZERO)
        for resource in Q.RESOURCES:
            out.append(("llmgw_capacity_holds", (label, resource), float(getattr(h, resource))))
            for series, amount in (("llmgw_capacity_guarantee", q.guarantee), ("llmgw_capacity_limit", q.limit)):
                value = getattr(amount, resource)
                if value is not None:
                    out.append((series, (label, resource), float(value)))
    return out
