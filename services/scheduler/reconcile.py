"""One reconcile pass (SPEC SCHED-2, SCHED-4, FLEET-2, FLEET-4): the cluster as it is → decisions.

Pure: it reads a :class:`ClusterState` and the clock it is given, and returns decisions; the
shell appends them as events. Order of work in a pass, and why:

1. nodes first — register what reported in, mark lost what went silent — because placement
   must not use a node that is gone, and replicas on a lost node must be replaced;
2. then each model in name order (determinism): stop what must not run (stopped, parked,
   removed, above max), park after repeated failures, replace what drains, place up to min.
   Reservations made earlier in the pass count for later placements, so one pass never
   over-commits a node.
"""

from __future__ import annotations

import os
from datetime import datetime

import msgspec

from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema.models import mirror_ref
from llmgw.services.scheduler import autoscale as AS
from llmgw.services.scheduler import preemption as PRE
from llmgw.services.scheduler.placement import (
    Candidate,
    Need,
    Verdict,
    cores_on,
    evaluate,
    need_of,
    pick,
    profile_order,
    reserve,
    summarise,
)
from llmgw.services.scheduler.quota import Ledger, Shares, guarantee_words
from llmgw.services.scheduler.state import ClusterState, ModelState, ReplicaState, capacity_of


class Config(msgspec.Struct, frozen=True, kw_only=True):
    lost_after_s: float = 30.0
    park_after: int = 5
    backoff_base_s: float = 2.0
    backoff_cap_s: float = 300.0
    stop_grace_s: float = 30.0
    idle_s: float = 300.0  # an on-demand model's replica stops after this long without a request
    forget_after_s: float = 3600.0  # stopped and failed replicas placed longer ago leave the state
    # A scheduler that has heard from no node yet (`llmgw up`'s agent starts a moment after it) waits
    # this long for one before it calls a model unplaceable for want of nodes.
    first_node_wait_s: float = 30.0
    # Preemption (SCHED-7); off for the headroom question, which asks what fits without taking anything.
    preempt: bool = True
    preempt_min_age_s: float = PRE.MIN_AGE_S
    preempt_max_victims: int = PRE.MAX_VICTIMS
    preempt_grace_s: float = PRE.GRACE_S
    preempt_hold_s: float = PRE.HOLD_S
    preempt_idle_s: float = 60.0  # an on-demand model with no request for this long: its replicas go first
    # Autoscaling (SCHED-9, services/scheduler/autoscale.py): between min and max, with the engines' load.
    scale_up_after_s: float = 60.0  # waiting requests held this long add a replica
    scale_down_after_s: float = 600.0  # nothing waiting this long removes one the load added
    scale_up_waiting_per_replica: float = 1.0
    scale_down_below: float = 0.7  # …if the busiest moment fits in the rest under this share of them


def wanted_replicas(m: ModelState, demand_at: float | None, now_epoch: float, cfg: Config) -> tuple[int, int]:
    """(min, max) to hold now. An on-demand model (min 0) holds one replica while requests come,
    and none once it has been idle for ``idle_s`` (SCHED-12)."""
    if m.min > 0:
        return m.min, max(m.max, m.min)
    if demand_at is not None and now_epoch - demand_at < cfg.idle_s:
        return 1, max(m.max, 1)
    return 0, 0


class Clock(msgspec.Struct, frozen=True, kw_only=True):
    monotonic: float  # for heartbeats this process saw
    epoch: float  # for event times (backoff)
    started: float  # monotonic time this scheduler started: a grace for nodes not yet heard from


# -- decisions ----------------------------------------------------------------------------------


class RegisterNode(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    capacity: N.NodeCapacity
    changed: bool  # an update of a known node, not a first registration


class MarkLost(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    silent_s: float


class MarkReturned(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str


class Place(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    node_id: str
    gpus: list[int]
    need: Need
    why: str
    profile: int = 0  # which of the model's profiles it runs (an index into spec.profiles)
    replaces: str = ""  # a restart's replacement (SCHED-6): the replica it replaces once ready


class Stop(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    reason: str
    grace_s: float
    short: bool = False  # the model holds fewer ready replicas than it should once this one stops


class Fail(msgspec.Struct, frozen=True, kw_only=True):
    """A replica on a lost node (the only failures the scheduler records itself)."""

    replica_id: str
    node_id: str
    reason: str


class Park(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    reason: str
    failures: int


class Blocked(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    reason: str
    wanted: int
    verdicts: list[Verdict] = []


class Waiting(msgspec.Struct, frozen=True, kw_only=True):
    """A model backing off between failed starts, held back after giving way, or waiting for the
    replicas that give way to it to drain; nothing to do until ``until``."""

    model: str
    until: float
    why: str = ""


class Preempt(msgspec.Struct, frozen=True, kw_only=True):
    """Replicas of ``model`` give way to ``for_model`` (SCHED-7); each also gets its own :class:`Stop`."""

    model: str
    replicas: list[str]
    node_id: str
    capacity_class: str
    for_model: str
    for_class: str
    reason: str
    at: float
    held_until: float


Autoscale = AS.Autoscale

Decision = RegisterNode | MarkLost | MarkReturned | Place | Stop | Fail | Park | Blocked | Waiting | Preempt | Autoscale


def backoff_s(failures: int, cfg: Config) -> float:
    """Doubling backoff between start attempts: base, 2·base, 4·base, … up to the cap."""
    if failures <= 0:
        return 0.0
    return min(cfg.backoff_base_s * 2 ** (failures - 1), cfg.backoff_cap_s)


# -- candidates: the cluster as placement sees it -------------------------------------------------


def _node_view(state: ClusterState) -> dict[str, Candidate]:
    """Every registered node with what its replicas hold, for no model in particular."""
    out: dict[str, Candidate] = {}
    for n in state.nodes.values():
        if not n.registered or n.capacity is None:
            continue
        held = [r for r in state.replicas_on(n.id) if r.active or r.state == "draining"]
        hb = n.heartbeat
        unusable = ""
        if n.lost:
            unusable = "lost (no heartbeat)"
        elif n.draining:
            unusable = "draining"
        elif n.cordoned:
            unusable = "cordoned" + (f" ({n.cordon_reason})" if n.cordon_reason else "")
        cap = n.capacity
        out[n.id] = Candidate(
            node_id=n.id,
            unusable=unusable,
            engines=list(cap.engines),
            labels=dict(cap.labels),
            cpus=cap.cpus,
            reserved_cores=sum(r.cores for r in held),
            memory_total_bytes=cap.memory_total_bytes,
            reserved_memory_bytes=sum(r.memory_bytes for r in held),
            gpus={g.index: g.memory_total_mb for g in cap.gpus},
            reserved_gpus=[i for r in held for i in r.gpus],
            disk_free_bytes=hb.disk_free_bytes if hb else None,
            replicas=len(held),
        )
    return out


def _weights_index(state: ClusterState) -> dict[str, set[str]]:
    """Model name → nodes holding its weights: a weights entry ``a/b/c`` holds ``a/b/c``, ``a/b`` and ``a``
    (the same test as ``w == model or w.startswith(model + "/")``, done once per pass, not per model)."""
    out: dict[str, set[str]] = {}
    for n in state.nodes.values():
        if n.heartbeat is None:
            continue
        for w in n.heartbeat.weights:
            out.setdefault(w, set()).add(n.id)
            i = w.find("/")
            while i >= 0:
                out.setdefault(w[:i], set()).add(n.id)
                i = w.find("/", i + 1)
    return out


def _for_model(
    view: dict[str, Candidate], state: ClusterState, model: str, weights: dict[str, set[str]]
) -> dict[str, Candidate]:
    """``view`` with the fields that depend on the model: its replicas on each node, its weights."""
    out = dict(view)
    counts: dict[str, int] = {}
    for r in state.replicas_of(model):
        if r.active and r.node_id in out:
            counts[r.node_id] = counts.get(r.node_id, 0) + 1
    for node_id, k in counts.items():
        out[node_id] = msgspec.structs.replace(out[node_id], model_replicas=k)
    holders = set(weights.get(model, ()))
    m = state.models.get(model)
    if m is not None:
        # A model served from the mirror is held under its source's MODEL/VERSION/FILE, whatever the
        # catalog calls it.
        try:
            ref = mirror_ref(m.spec.source)
        except ValueError:
            ref = None
        if ref:
            holders |= weights.get(ref, set())
        elif m.spec.source.startswith("/"):
            # A local source: nodes report the weight files under their model directories by path.
            holders |= weights.get(os.path.normpath(m.spec.source), set())
    for node_id in holders:
        if node_id in out:
            out[node_id] = msgspec.structs.replace(out[node_id], has_weights=True)
    return out


def candidates(state: ClusterState, model: str) -> dict[str, Candidate]:
    return _for_model(_node_view(state), state, model, _weights_index(state))


# -- the pass -----------------------------------------------------------------------------------


class _Pass:
    """What one pass learns as it goes: replicas failed, nodes lost, and the nodes as placement
    sees them — built once, on the first placement, then updated with each reservation the pass
    makes, so later placements count earlier ones and one pass never over-commits a node."""

    def __init__(self, state: ClusterState, now: float = 0.0) -> None:
        self.state = state
        self.now = now  # epoch seconds: which preemption holds still last
        self.failed_now: set[str] = set()
        self.lost_now: set[str] = set()
        self.draining_nodes = {n.id for n in state.nodes.values() if n.draining}
        self._view: dict[str, Candidate] | None = None
        self._weights: dict[str, set[str]] = {}
        self.preempted: set[str] = set()  # replicas given way in this pass: not taken twice
        self._holders_on: dict[str, list[PRE.Holder]] = {}
        self._sides: dict[str, PRE.ModelSide | None] = {}
        self._shares: Shares | None = None
        self._gave_way: dict[str, list[M.ModelPreempted]] | None = None
        self._earmarks: dict[str, str] | None = None
        self._quota: Ledger | None = None

    @property
    def quota(self) -> Ledger:
        """What each scope holds, counting this pass's placements (SCHED-8): built on the first placement."""
        if self._quota is None:
            self._quota = Ledger(self.state)
        return self._quota

    @property
    def view(self) -> dict[str, Candidate]:
        if self._view is None:
            self._view = _node_view(self.state)
            for node_id in self.lost_now:
                if node_id in self._view:
                    self._view[node_id] = msgspec.structs.replace(self._view[node_id], unusable="lost (no heartbeat)")
            self._weights = _weights_index(self.state)
        return self._view

    def candidates(self, model: str) -> dict[str, Candidate]:
        view = self.view
        cs = _for_model(view, self.state, model, self._weights)
        for node_id, winner in self.earmarks().items():
            # The room replicas gave up on a node is its winner's until it is placed (or the hold ends):
            # without this, a model that comes earlier in the pass takes it and the winner preempts again.
            if winner != model and node_id in cs and not cs[node_id].unusable:
                why = f"held for {winner}: replicas gave way there for it"
                cs[node_id] = msgspec.structs.replace(cs[node_id], unusable=why)
        return cs

    def earmarks(self) -> dict[str, str]:
        """Node → the model replicas gave way there for, while that model is not placed and its hold lasts."""
        if self._earmarks is None:
            self._earmarks = {}
            for m in self.state.models.values():
                for pre in m.gave_way:
                    if self.now < pre.held_until and not _winner_served(self.state, pre):
                        self._earmarks[pre.node_id] = pre.for_model
        return self._earmarks

    def reserve(self, node_id: str, need: Need, gpus: list[int]) -> None:
        self.view[node_id] = reserve(self.view[node_id], need, gpus, model_replica=False)

    def holders_on(self, node_id: str, clock: Clock) -> list[PRE.Holder]:
        """The running replicas on a node as possible victims (SCHED-7): built per node, on the first
        preemption that asks about it (most passes try none, and most nodes cannot take the winner)."""
        held = self._holders_on.get(node_id)
        if held is None:
            if self._shares is None and self.state.quotas:
                self._shares = Shares(self.state)
            shares = self._shares
            held = self._holders_on[node_id] = []
            for r in self.state.replicas_on(node_id):
                if not r.active or r.id in self.failed_now:
                    continue
                protected, borrowed = shares.share(r) if shares else ("", False)
                held.append(
                    PRE.Holder(
                        replica_id=r.id,
                        model=r.model,
                        node_id=node_id,
                        age_s=clock.epoch - r.placed_at,
                        cores=r.cores,
                        memory_bytes=r.memory_bytes,
                        gpus=list(r.gpus),
                        protected=protected,
                        borrowed=borrowed,
                    )
                )
        return held

    def side_of(self, model: str, clock: Clock, cfg: Config) -> PRE.ModelSide | None:
        """What preemption needs of a model whose replicas might give way; None for one not in the catalog."""
        if model not in self._sides:
            m = self.state.models.get(model)
            side = None
            if m is not None:
                live = sum(1 for r in self.state.replicas_of(model) if r.active and r.id not in self.failed_now)
                used = self.state.demand.get(model)
                side = PRE.ModelSide(
                    name=model,
                    capacity_class=PRE.class_of(m.spec, m.min),
                    extras=max(live - m.min, 0),
                    on_demand_idle=m.min == 0 and (used is None or clock.epoch - used >= cfg.preempt_idle_s),
                    last_used=used or 0.0,
                )
            self._sides[model] = side
        return self._sides[model]

    def gave_way_to(self, model: str, now: float) -> list[M.ModelPreempted]:
        """The preemptions made for ``model`` whose hold still lasts."""
        if self._gave_way is None:
            self._gave_way = {}
            for m in self.state.models.values():
                for pre in m.gave_way:
                    if now < pre.held_until:
                        self._gave_way.setdefault(pre.for_model, []).append(pre)
        return self._gave_way.get(model, [])


def reconcile(state: ClusterState, clock: Clock, cfg: Config) -> list[Decision]:
    p = _Pass(state, clock.epoch)
    decisions: list[Decision] = []
    decisions += _nodes(state, clock, cfg, p.failed_now)
    p.lost_now = {d.node_id for d in decisions if isinstance(d, MarkLost)}

    for name in sorted(state.models):
        m = state.models[name]
        live = [r for r in state.replicas_of(name) if r.active and r.id not in p.failed_now]
        decisions += _model(state, m, live, clock, cfg, p)

    gone = [
        r
        for model in state.replica_models()
        if model not in state.models
        for r in state.replicas_of(model)
        if r.active and r.id not in p.failed_now
    ]
    for r in sorted(gone, key=lambda r: r.id):
        decisions.append(Stop(replica_id=r.id, reason=f"model {r.model} was removed", grace_s=cfg.stop_grace_s))
    return decisions


def _nodes(state: ClusterState, clock: Clock, cfg: Config, failed_now: set[str]) -> list[Decision]:
    out: list[Decision] = []
    for node_id in sorted(state.nodes):
        n = state.nodes[node_id]
        if n.heartbeat is not None:
            cap = capacity_of(n.heartbeat)
            if not n.registered:
                out.append(RegisterNode(node_id=node_id, capacity=cap, changed=False))
            elif cap != n.capacity:
                out.append(RegisterNode(node_id=node_id, capacity=cap, changed=True))
        if not n.registered and n.heartbeat is None:
            continue
        seen = n.last_seen if n.last_seen is not None else clock.started
        silent = clock.monotonic - seen
        if n.lost:
            if n.last_seen is not None and silent < cfg.lost_after_s:
                out.append(MarkReturned(node_id=node_id))
            else:
                for r in sorted(state.replicas_on(node_id), key=lambda r: r.id):
                    if r.active:  # e.g. placed by an earlier leader just before the loss
                        failed_now.add(r.id)
                        out.append(Fail(replica_id=r.id, node_id=node_id, reason=f"node {node_id} lost"))
            continue
        if silent >= cfg.lost_after_s:
            out.append(MarkLost(node_id=node_id, silent_s=round(silent, 1)))
            for r in sorted(state.replicas_on(node_id), key=lambda r: r.id):
                if r.active or r.state == "draining":
                    failed_now.add(r.id)
                    out.append(
                        Fail(
                            replica_id=r.id,
                            node_id=node_id,
                            reason=f"node {node_id} lost: no heartbeat for {silent:.0f}s",
                        )
                    )
    return out


def _model(
    state: ClusterState,
    m: ModelState,
    live: list[ReplicaState],
    clock: Clock,
    cfg: Config,
    p: _Pass,
) -> list[Decision]:
    out: list[Decision] = []
    grace = cfg.stop_grace_s
    if m.stopped or m.parked:
        why = "stopped by an administrator" if m.stopped else f"parked: {m.parked}"
        # Parking stops what cannot start, not what serves: replicas of an earlier definition that are
        # ready keep answering while the new one fails (a bad edit must not take a model down).
        going = live if m.stopped else [r for r in live if r.state != "ready"]
        return [
            Stop(replica_id=r.id, reason=f"model {m.name} {why}", grace_s=grace)
            for r in sorted(going, key=lambda r: r.id)
        ]
    if m.failures >= cfg.park_after:
        return [
            Park(model=m.name, reason=f"{m.failures} failed starts in a row; last: {m.last_error}", failures=m.failures)
        ]

    lower, upper = wanted_replicas(m, state.demand.get(m.name), clock.epoch, cfg)
    moving = [r for r in live if r.node_id in p.draining_nodes]
    staying = [r for r in live if r.node_id not in p.draining_nodes]
    # A restart's replacement is not one of the model's replicas while its old one runs (SCHED-6).
    from llmgw.services.scheduler import restarts  # it builds on this module's decisions

    surge = restarts.surge(staying)
    replacements = [r for r in staying if r.id in surge]
    staying = [r for r in staying if r.id not in surge]
    # The load moves what the model holds between min and max, one step at a time (SCHED-9).
    # A saved measurement (SCHED-10) of the profile and node shape the replicas run on sets the lines.
    measured = AS.measurement_of(
        m, staying, [state.nodes[r.node_id].capacity for r in staying if r.node_id in state.nodes]
    )
    lower, upper, scaled = AS.adjust(m, lower, upper, staying, state.load.get(m.name), clock, cfg, measured)
    if scaled is not None:
        out.append(scaled)
    # A drain replaces first, then stops the old replica (FLEET-4): it waits for as many ready
    # replicas elsewhere as the model holds now (`lower`, so an on-demand model in use waits too),
    # but no longer than the drain's grace: a node being emptied must empty, even when no other node
    # has room (the model is then short, and says so, until one has).
    ready_staying = [r for r in staying if r.state == "ready"]
    for r in sorted(moving, key=lambda r: r.id):
        n = state.nodes[r.node_id]
        if len(ready_staying) >= lower:
            out.append(Stop(replica_id=r.id, reason=f"node {r.node_id} drained", grace_s=n.drain_grace_s))
        elif n.drain_requested_at is not None and clock.epoch - n.drain_requested_at >= n.drain_grace_s:
            reason = (
                f"node {r.node_id} drained; no replacement was ready elsewhere within the drain's "
                f"{n.drain_grace_s:.0f}s, so {m.name} is short until a node has room"
            )
            out.append(Stop(replica_id=r.id, reason=reason, grace_s=cfg.stop_grace_s, short=True))

    if len(staying) > upper:
        # Scale down, placement's scores in reverse: not-yet-ready replicas first, then those waiting
        # for a restart (SCHED-6), then those on the node with most of this model's replicas (spread),
        # then on the busiest node (most replicas of any model), newest first.
        per_node: dict[str, int] = {}
        for r in staying:
            per_node[r.node_id] = per_node.get(r.node_id, 0) + 1
        load = {
            node_id: sum(1 for x in state.replicas_on(node_id) if x.active or x.state == "draining")
            for node_id in per_node
        }
        order = sorted(
            staying,
            key=lambda r: (
                r.state == "ready",
                not restarts.needs_restart(r, m.spec_hash),
                -per_node[r.node_id],
                -load[r.node_id],
                -r.placed_at,
                r.id,
            ),
        )
        for r in order[: len(staying) - upper]:
            why = (
                f"idle on-demand model {m.name}: no request for {cfg.idle_s:.0f}s"
                if m.min == 0 and upper == 0
                else f"model {m.name} autoscaled to {upper}: {scaled.reason}"
                if scaled is not None and scaled.to == upper
                else f"model {m.name} scaled to max {upper}"
            )
            out.append(Stop(replica_id=r.id, reason=why, grace_s=grace))
        return out

    missing = lower - len(staying)
    if missing <= 0:
        return [*out, *restarts.step(state, m, staying, replacements, clock, cfg, p)]
    if m.failures and m.last_failure_at is not None:
        until = m.last_failure_at + backoff_s(m.failures, cfg)
        if clock.epoch < until:
            return [*out, Waiting(model=m.name, until=until)]
    if not m.spec.profiles:
        return [*out, Blocked(model=m.name, reason=f"model {m.name} has no profile", wanted=missing)]
    order = profile_order(m.spec.profiles)
    needs = {k: need_of(m.spec.profiles[k]) for k in order}
    if (held := held_back(state, m, clock)) is not None and not (
        # A hold never keeps a scope below its guarantee (SCHED-8): that room is its own.
        state.quotas and p.quota.guarantee_room(m.name, needs[order[0]]) is not None
    ):
        return [*out, held]
    cs: dict[str, Candidate] | None = None  # the nodes as this model's placements see them, kept up to date
    verdicts_of: dict[int, dict[str, Verdict]] = {}  # profile -> node -> verdict, redone only where it changed
    for i in range(missing):
        if (limit := p.quota.block_all(m.name, list(needs.values()))) is not None:  # SCHED-8, before preempting
            out.append(Blocked(model=m.name, reason=limit, wanted=missing - i))
            break
        if cs is None:
            cs = p.candidates(m.name)
        seed = f"{m.name}/{len(staying) + i}/{state.position}"
        # The profiles in order of preference: the first that fits anywhere is placed (CAT-2).
        tried: list[tuple[int, list[Verdict]]] = []
        choice = None
        for k in order:
            if (judged := verdicts_of.get(k)) is None:
                judged = verdicts_of[k] = {v.node_id: v for v in evaluate(list(cs.values()), needs[k])}
            verdicts = list(judged.values())
            choice = pick(verdicts, cs.__getitem__, needs[k], seed)
            if choice is not None:
                break
            tried.append((k, verdicts))
        if choice is None:
            first = tried[0][1]
            waited = clock.monotonic - clock.started
            if not first and waited < cfg.first_node_wait_s:  # no node yet: the fleet is still starting
                out.append(Waiting(model=m.name, until=clock.epoch + cfg.first_node_wait_s - waited))
                break
            if cfg.preempt:
                taking = _preempt(state, m, len(staying) + i, [(k, needs[k]) for k in order], cs, seed, clock, cfg, p)
                if taking:
                    out += taking
                    break
            out.append(Blocked(model=m.name, reason=_unplaceable(m, tried), wanted=missing - i, verdicts=first))
            break
        # The cores as they are on the chosen node (the threads rule's share when the profile names none).
        placed = msgspec.structs.replace(needs[k], cores=cores_on(needs[k], cs[choice.node_id].cpus))
        if (limit := p.quota.admit(m.name, placed)) is not None:  # SCHED-8: the owner's capacity limits
            out.append(Blocked(model=m.name, reason=limit, wanted=missing - i))
            break
        p.reserve(choice.node_id, placed, choice.gpus)
        # Only the node it took changes for this model's next replica: its verdicts alone are redone.
        cs[choice.node_id] = reserve(cs[choice.node_id], placed, choice.gpus)
        for j, judged in verdicts_of.items():
            [judged[choice.node_id]] = evaluate([cs[choice.node_id]], needs[j])
        why = f"{len(staying) + i} of {lower} wanted; best of {choice.fitting} fitting nodes"
        if len(order) > 1:
            why += f"; profile {m.spec.profiles[k].name}" + "".join(
                f" (preferred {m.spec.profiles[t].name} fits nowhere: {_first_reason(v)})" for t, v in tried
            )
        out.append(Place(model=m.name, node_id=choice.node_id, gpus=choice.gpus, need=placed, why=why, profile=k))
    return out


def held_back(state: ClusterState, m: ModelState, clock: Clock) -> Waiting | None:
    """A model that gave way waits until the winner is placed or its hold ends, so that its replicas
    do not take back the room they just gave (SCHED-7)."""
    holding = [pre for pre in m.gave_way if clock.epoch < pre.held_until and not _winner_served(state, pre)]
    if not holding:
        return None  # every winner is placed (the holds did their work), or the holds ended
    pre = max(holding, key=lambda pre: pre.held_until)
    return Waiting(model=m.name, until=pre.held_until, why=f"gave room to {pre.for_model}")


def _winner_served(state: ClusterState, pre: M.ModelPreempted) -> bool:
    """Whether the model a preemption made room for has what it was short of (or is gone): as many
    running replicas as its minimum (one, on demand). Not merely "a replica placed since": a winner
    short by two is placed once in the very pass that preempts for its second, and that placement
    must not end the second preemption's hold."""
    m = state.models.get(pre.for_model)
    if m is None:
        return True
    running = sum(1 for r in state.replicas_of(pre.for_model) if r.active)
    return running >= max(m.min, 1)


def try_preempt(state: ClusterState, m: ModelState, have: int, clock: Clock, cfg: Config) -> list[Decision]:
    """What a pass would decide, by preemption, for one more replica of ``m`` that fits nowhere (``ctl
    explain`` asks; the pass itself calls :func:`_preempt` with what it has built)."""
    order = profile_order(m.spec.profiles)
    p = _Pass(state, clock.epoch)
    return _preempt(
        state, m, have, [(k, need_of(m.spec.profiles[k])) for k in order], p.candidates(m.name), m.name, clock, cfg, p
    )


def _preempt(
    state: ClusterState,
    m: ModelState,
    have: int,
    needs: list[tuple[int, Need]],
    cs: dict[str, Candidate],
    seed: str,
    clock: Clock,
    cfg: Config,
    p: _Pass,
) -> list[Decision]:
    """Stops that make room for one more replica of ``m`` (tried once plain placement failed), or,
    while replicas that gave way to it still drain, a wait for them; empty when nothing may give way."""
    waiting = [
        rid
        for pre in p.gave_way_to(m.name, clock.epoch)
        for rid in pre.replicas
        if (r := state.replicas.get(rid)) is not None and (r.active or r.state == "draining")
    ]
    if waiting:
        until = min(pre.held_until for pre in p.gave_way_to(m.name, clock.epoch))
        return [Waiting(model=m.name, until=until, why=f"waiting for {len(waiting)} replicas that gave way to drain")]
    cls = PRE.class_of(m.spec, m.min)
    for _, need in needs:  # the profiles in order of preference, as plain placement tried them
        winner = PRE.Winner(
            model=m.name,
            capacity_class=cls,
            below_minimum=have < m.min,
            reclaims=bool(state.quotas) and p.quota.guarantee_room(m.name, need) is not None,
            own_guarantees=guarantee_words(state, m.name) if state.quotas else frozenset(),
        )
        found = PRE.find(
            cs,
            need,
            winner,
            lambda node_id: p.holders_on(node_id, clock),
            lambda model: p.side_of(model, clock, cfg),
            seed=seed,
            taken=p.preempted,
            max_victims=cfg.preempt_max_victims,
            min_age_s=cfg.preempt_min_age_s,
        )
        if found is not None:
            break
    else:
        return []
    out: list[Decision] = []
    by_model: dict[str, list[PRE.Victim]] = {}
    for v in found.victims:
        by_model.setdefault(v.holder.model, []).append(v)
        p.preempted.add(v.holder.replica_id)
    for name, victims in sorted(by_model.items()):
        ids = [v.holder.replica_id for v in victims]
        words = sorted({PRE.TIER_WORDS[v.tier] for v in victims})
        reason = f"gave room to {m.name} ({cls}) on {found.node_id}: {', '.join(words)}"
        out.append(
            Preempt(
                model=name,
                replicas=ids,
                node_id=found.node_id,
                capacity_class=victims[0].capacity_class,
                for_model=m.name,
                for_class=cls,
                reason=reason,
                at=clock.epoch,
                held_until=clock.epoch + cfg.preempt_hold_s,
            )
        )
        out += [Stop(replica_id=rid, reason=f"preempted: {reason}", grace_s=cfg.preempt_grace_s) for rid in ids]
    return out


def _first_reason(verdicts: list[Verdict]) -> str:
    return summarise(verdicts, limit=2).removeprefix("no node fits — ")


def _unplaceable(m: ModelState, tried: list[tuple[int, list[Verdict]]]) -> str:
    """Why no profile of ``m`` fits: the preferred one's nodes, then each fallback's, by name."""
    if len(tried) == 1:
        return summarise(tried[0][1])
    return " · ".join(f"profile {m.spec.profiles[k].name}: {summarise(v)}" for k, v in tried)


# -- decisions as events -------------------------------------------------------------------------


def event_of(
    d: Decision, state: ClusterState, *, replica_id: str, term: int, last_seen: datetime
) -> tuple[str, str, msgspec.Struct] | None:
    """(aggregate, id, payload) the shell appends for a decision; None for those it does not write
    as such (Waiting; Blocked, which the shell rate-limits). Pure, so tests fold exactly what the
    service would write. ``replica_id`` names a new replica; ``last_seen`` dates a lost node."""
    match d:
        case RegisterNode():
            cls = N.NodeCapacityChanged if d.changed else N.NodeRegistered
            return N.AGGREGATE, d.node_id, cls(node_id=d.node_id, capacity=d.capacity)
        case MarkLost():
            return N.AGGREGATE, d.node_id, N.NodeLost(node_id=d.node_id, last_seen=last_seen, silent_s=d.silent_s)
        case MarkReturned():
            return N.AGGREGATE, d.node_id, N.NodeReturned(node_id=d.node_id)
        case Fail():
            return (
                R.AGGREGATE,
                d.replica_id,
                R.ReplicaFailed(replica_id=d.replica_id, node_id=d.node_id, reason=d.reason, node_lost=True),
            )
        case Stop():
            return (
                R.AGGREGATE,
                d.replica_id,
                R.ReplicaStopRequested(replica_id=d.replica_id, reason=d.reason, grace_s=d.grace_s),
            )
        case Park():
            return M.AGGREGATE, d.model, M.ModelParked(reason=d.reason, failures=d.failures)
        case AS.Autoscale():
            return M.AGGREGATE, d.model, AS.event_of(d)
        case Preempt():
            return (
                M.AGGREGATE,
                d.model,
                M.ModelPreempted(
                    replicas=d.replicas,
                    node_id=d.node_id,
                    capacity_class=d.capacity_class,
                    for_model=d.for_model,
                    for_class=d.for_class,
                    reason=d.reason,
                    at=d.at,
                    held_until=d.held_until,
                ),
            )
        case Place():
            m = state.models[d.model]
            return (
                R.AGGREGATE,
                replica_id,
                R.ReplicaPlaced(
                    replica_id=replica_id,
                    model=d.model,
                    node_id=d.node_id,
                    source=m.spec.source,
                    profile=m.spec.profiles[d.profile],
                    spec_hash=m.spec_hash,
                    cores=d.need.cores,
                    memory_bytes=d.need.memory_bytes,
                    gpus=d.gpus,
                    term=term,
                    why=d.why,
                    replaces=d.replaces,
                ),
            )
    return None
