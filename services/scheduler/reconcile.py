"""One reconcile pass (SPEC SCHED-2, SCHED-4, FLEET-2, FLEET-4): the cluster as it is → decisions.

Pure: it reads a :class:`ClusterState` and the :class:`Clock` it is given, and returns decisions
(``vocabulary.py``); the shell (``service.py``) appends them as events. What the pass has decided so
far, it keeps in a :class:`PassState` (``pass_state.py``). Order of work in a pass, and why:

1. nodes first (:func:`_nodes`) — register what reported in, mark lost what went silent — because
   placement must not use a node that is gone, and replicas on a lost node must be replaced;
2. then each model in name order (determinism), step by step (:func:`_model`):

   a. stop what must not run: a stopped model's replicas, a parked one's that are not ready
      (:func:`_stop_what_must_not_run`);
   b. park after ``park_after`` failed starts in a row (:func:`_park`);
   c. what it holds now (:func:`_holding`): min and max, or one while an on-demand model is used,
      moved by autoscaling (``autoscale.py``); its replicas on draining nodes apart, and restarts'
      replacements (surge) apart;
   d. replace what drains (:func:`_replace_what_drains`): stop a drained node's replica once enough
      are ready elsewhere, or once the drain's grace is over;
   e. above max: scale down (:func:`_scale_down`); at what it holds: the next restart step
      (``restarts.py``); below it: place up to it (:func:`_place_up_to`), backing off after failed
      starts, held back after giving way, preempting when nothing fits (:func:`_preempt`);

3. last, stop the replicas of removed models (:func:`_removed`).

Reservations made earlier in the pass count for later placements, so one pass never over-commits
a node.
"""

from __future__ import annotations

import msgspec

from llmgw.services.scheduler import autoscale as AS
from llmgw.services.scheduler import preemption as PRE
from llmgw.services.scheduler import restarts
from llmgw.services.scheduler.pass_state import PassState, winner_served
from llmgw.services.scheduler.placement import (
    Candidate,
    Choice,
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
from llmgw.services.scheduler.quota import guarantee_words
from llmgw.services.scheduler.state import ClusterState, ModelState, ReplicaState, capacity_of
from llmgw.services.scheduler.vocabulary import (
    Autoscale,
    Blocked,
    Clock,
    Config,
    Decision,
    Fail,
    MarkLost,
    MarkReturned,
    Park,
    Place,
    Preempt,
    RegisterNode,
    Stop,
    Waiting,
    backing_off,
)


def reconcile(state: ClusterState, clock: Clock, cfg: Config) -> list[Decision]:
    """Every decision of one pass, in the order the shell appends them."""
    p = PassState(state, clock.epoch)
    decisions: list[Decision] = []
    decisions += _nodes(state, clock, cfg, p.failed_now)
    p.lost_now = {d.node_id for d in decisions if isinstance(d, MarkLost)}

    for name in sorted(state.models):
        m = state.models[name]
        live = [r for r in state.replicas_of(name) if r.active and r.id not in p.failed_now]
        decisions += _model(state, m, live, clock, cfg, p)

    decisions += _removed(state, cfg, p)
    return decisions


def wanted_replicas(m: ModelState, demand_at: float | None, now_epoch: float, cfg: Config) -> tuple[int, int]:
    """(min, max) to hold now. An on-demand model (min 0) holds one replica while requests come,
    and none once it has been idle for ``idle_s`` (SCHED-12)."""
    if m.min > 0:
        return m.min, max(m.max, m.min)
    if demand_at is not None and now_epoch - demand_at < cfg.idle_s:
        return 1, max(m.max, 1)
    return 0, 0


# -- 1. nodes -------------------------------------------------------------------------------------


def _nodes(state: ClusterState, clock: Clock, cfg: Config, failed_now: set[str]) -> list[Decision]:
    """Register what reported in, mark lost what went silent (failing its replicas: ``failed_now``
    collects them), and mark returned a lost node heard from again."""
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


# -- 2. each model --------------------------------------------------------------------------------


class _Holding(msgspec.Struct, frozen=True, kw_only=True):
    """What a model holds this pass, worked out once for the steps after it (:func:`_holding`)."""

    lower: int  # replicas it holds now: min (one while an on-demand model is used), moved by its load
    upper: int  # the most it may hold now: max, or ``lower`` after a step down
    moving: list[ReplicaState]  # its replicas on draining nodes: replaced, then stopped
    staying: list[ReplicaState]  # the rest, restarts' replacements aside: what counts against lower and upper
    replacements: list[ReplicaState]  # restarts' new copies whose old replica still runs (surge)
    scaled: Autoscale | None  # the autoscaling step this pass takes, if one is due


def _model(
    state: ClusterState,
    m: ModelState,
    live: list[ReplicaState],
    clock: Clock,
    cfg: Config,
    p: PassState,
) -> list[Decision]:
    """One model's decisions, its steps in the order the module's docstring gives (2a–2e)."""
    if m.stopped or m.parked:
        return _stop_what_must_not_run(m, live, cfg)
    if m.failures >= cfg.park_after:
        return [_park(m)]
    h = _holding(state, m, live, clock, cfg, p)
    out: list[Decision] = [h.scaled] if h.scaled is not None else []
    out += _replace_what_drains(state, m, h, clock, cfg)
    if len(h.staying) > h.upper:
        return out + _scale_down(state, m, h, cfg)
    missing = h.lower - len(h.staying)
    if missing <= 0:
        return out + restarts.step(state, m, h.staying, h.replacements, clock, cfg, p)
    return out + _place_up_to(state, m, h, missing, clock, cfg, p)


def _stop_what_must_not_run(m: ModelState, live: list[ReplicaState], cfg: Config) -> list[Decision]:
    """A stopped model's replicas, and a parked one's that are not ready."""
    why = "stopped by an administrator" if m.stopped else f"parked: {m.parked}"
    # Parking stops what cannot start, not what serves: replicas of an earlier definition that are
    # ready keep answering while the new one fails (a bad edit must not take a model down).
    going = live if m.stopped else [r for r in live if r.state != "ready"]
    return [
        Stop(replica_id=r.id, reason=f"model {m.name} {why}", grace_s=cfg.stop_grace_s)
        for r in sorted(going, key=lambda r: r.id)
    ]


def _park(m: ModelState) -> Park:
    return Park(model=m.name, reason=f"{m.failures} failed starts in a row; last: {m.last_error}", failures=m.failures)


def _holding(
    state: ClusterState, m: ModelState, live: list[ReplicaState], clock: Clock, cfg: Config, p: PassState
) -> _Holding:
    """What ``m`` holds now, and which of its ``live`` replicas count towards it."""
    lower, upper = wanted_replicas(m, state.demand.get(m.name), clock.epoch, cfg)
    moving = [r for r in live if r.node_id in p.draining_nodes]
    staying = [r for r in live if r.node_id not in p.draining_nodes]
    # A restart's replacement is not one of the model's replicas while its old one runs (SCHED-6).
    surge = restarts.surge(staying)
    replacements = [r for r in staying if r.id in surge]
    staying = [r for r in staying if r.id not in surge]
    # The load moves what the model holds between min and max, one step at a time (SCHED-9).
    # A saved measurement (SCHED-10) of the profile and node shape the replicas run on sets the lines.
    measured = AS.measurement_of(
        m, staying, [state.nodes[r.node_id].capacity for r in staying if r.node_id in state.nodes]
    )
    lower, upper, scaled = AS.adjust(m, lower, upper, staying, state.load.get(m.name), clock, cfg, measured)
    return _Holding(lower=lower, upper=upper, moving=moving, staying=staying, replacements=replacements, scaled=scaled)


def _replace_what_drains(state: ClusterState, m: ModelState, h: _Holding, clock: Clock, cfg: Config) -> list[Decision]:
    """Stops for the model's replicas on draining nodes whose replacement is ready, or whose drain is over.

    A drain replaces first, then stops the old replica (FLEET-4): it waits for as many ready
    replicas elsewhere as the model holds now (``lower``, so an on-demand model in use waits too),
    but no longer than the drain's grace: a node being emptied must empty, even when no other node
    has room (the model is then short, and says so, until one has). The replacements themselves are
    placed by :func:`_place_up_to`, since the replicas moving do not count among those staying."""
    out: list[Decision] = []
    ready_staying = [r for r in h.staying if r.state == "ready"]
    for r in sorted(h.moving, key=lambda r: r.id):
        n = state.nodes[r.node_id]
        if len(ready_staying) >= h.lower:
            out.append(Stop(replica_id=r.id, reason=f"node {r.node_id} drained", grace_s=n.drain_grace_s))
        elif n.drain_requested_at is not None and clock.epoch - n.drain_requested_at >= n.drain_grace_s:
            reason = (
                f"node {r.node_id} drained; no replacement was ready elsewhere within the drain's "
                f"{n.drain_grace_s:.0f}s, so {m.name} is short until a node has room"
            )
            out.append(Stop(replica_id=r.id, reason=reason, grace_s=cfg.stop_grace_s, short=True))
    return out


def _scale_down(state: ClusterState, m: ModelState, h: _Holding, cfg: Config) -> list[Decision]:
    """Stops for the replicas above ``upper``, placement's scores in reverse: not-yet-ready replicas
    first, then those waiting for a restart (SCHED-6), then those on the node with most of this
    model's replicas (spread), then on the busiest node (most replicas of any model), newest first."""
    per_node: dict[str, int] = {}
    for r in h.staying:
        per_node[r.node_id] = per_node.get(r.node_id, 0) + 1
    load = {
        node_id: sum(1 for x in state.replicas_on(node_id) if x.active or x.state == "draining") for node_id in per_node
    }
    order = sorted(
        h.staying,
        key=lambda r: (
            r.state == "ready",
            not restarts.needs_restart(r, m.spec_hash),
            -per_node[r.node_id],
            -load[r.node_id],
            -r.placed_at,
            r.id,
        ),
    )
    upper, scaled = h.upper, h.scaled
    why = (
        f"idle on-demand model {m.name}: no request for {cfg.idle_s:.0f}s"
        if m.min == 0 and upper == 0
        else f"model {m.name} autoscaled to {upper}: {scaled.reason}"
        if scaled is not None and scaled.to == upper
        else f"model {m.name} scaled to max {upper}"
    )
    return [Stop(replica_id=r.id, reason=why, grace_s=cfg.stop_grace_s) for r in order[: len(h.staying) - upper]]


def _place_up_to(
    state: ClusterState, m: ModelState, h: _Holding, missing: int, clock: Clock, cfg: Config, p: PassState
) -> list[Decision]:
    """Places for the ``missing`` replicas, one at a time, each on the best node for the first profile
    (in order of preference) that fits anywhere. Before any: a wait while the model backs off after
    failed starts, or while it is held back after giving way. A replica that fits nowhere ends the
    model's step: a wait for the first node (a fleet still starting), a preemption, or a Blocked."""
    if (waiting := backing_off(m, clock, cfg)) is not None:
        return [waiting]
    if not m.spec.profiles:
        return [Blocked(model=m.name, reason=f"model {m.name} has no profile", wanted=missing)]
    order = profile_order(m.spec.profiles)
    needs = {k: need_of(m.spec.profiles[k]) for k in order}
    if (held := held_back(state, m, clock)) is not None and not (
        # A hold never keeps a scope below its guarantee (SCHED-8): that room is its own.
        state.quotas and p.quota.guarantee_room(m.name, needs[order[0]]) is not None
    ):
        return [held]
    out: list[Decision] = []
    have = len(h.staying)
    cs: dict[str, Candidate] | None = None  # the nodes as this model's placements see them, kept up to date
    verdicts_of: dict[int, dict[str, Verdict]] = {}  # profile -> node -> verdict, redone only where it changed
    for i in range(missing):
        if (limit := p.quota.block_all(m.name, list(needs.values()))) is not None:  # SCHED-8, before preempting
            out.append(Blocked(model=m.name, reason=limit, wanted=missing - i))
            break
        if cs is None:
            cs = p.candidates(m.name)
        seed = f"{m.name}/{have + i}/{state.position}"
        k, choice, tried = _first_fitting(order, needs, cs, verdicts_of, seed)
        if choice is None:
            first = tried[0][1]
            waited = clock.monotonic - clock.started
            if not first and waited < cfg.first_node_wait_s:  # no node yet: the fleet is still starting
                out.append(Waiting(model=m.name, until=clock.epoch + cfg.first_node_wait_s - waited))
                break
            if cfg.preempt:
                taking = _preempt(state, m, have + i, [(k, needs[k]) for k in order], cs, seed, clock, cfg, p)
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
        why = f"{have + i} of {h.lower} wanted; best of {choice.fitting} fitting nodes"
        if len(order) > 1:
            why += f"; profile {m.spec.profiles[k].name}" + "".join(
                f" (preferred {m.spec.profiles[t].name} fits nowhere: {_first_reason(v)})" for t, v in tried
            )
        out.append(Place(model=m.name, node_id=choice.node_id, gpus=choice.gpus, need=placed, why=why, profile=k))
    return out


def _first_fitting(
    order: list[int],
    needs: dict[int, Need],
    cs: dict[str, Candidate],
    verdicts_of: dict[int, dict[str, Verdict]],
    seed: str,
) -> tuple[int, Choice | None, list[tuple[int, list[Verdict]]]]:
    """The profiles in order of preference: the first that fits anywhere is placed (CAT-2). Returns
    that profile and its node, or the last profile and None, with the verdicts of each profile tried in
    vain before. ``verdicts_of`` keeps each profile's verdicts for the next replica."""
    tried: list[tuple[int, list[Verdict]]] = []
    choice = None
    k = order[0]
    for k in order:
        if (judged := verdicts_of.get(k)) is None:
            judged = verdicts_of[k] = {v.node_id: v for v in evaluate(list(cs.values()), needs[k])}
        verdicts = list(judged.values())
        choice = pick(verdicts, cs.__getitem__, needs[k], seed)
        if choice is not None:
            break
        tried.append((k, verdicts))
    return k, choice, tried


# -- giving way (SCHED-7) --------------------------------------------------------------------------


def held_back(state: ClusterState, m: ModelState, clock: Clock) -> Waiting | None:
    """A model that gave way waits until the winner is placed or its hold ends, so that its replicas
    do not take back the room they just gave (SCHED-7)."""
    holding = [pre for pre in m.gave_way if clock.epoch < pre.held_until and not winner_served(state, pre)]
    if not holding:
        return None  # every winner is placed (the holds did their work), or the holds ended
    pre = max(holding, key=lambda pre: pre.held_until)
    return Waiting(model=m.name, until=pre.held_until, why=f"gave room to {pre.for_model}")


def try_preempt(state: ClusterState, m: ModelState, have: int, clock: Clock, cfg: Config) -> list[Decision]:
    """What a pass would decide, by preemption, for one more replica of ``m`` that fits nowhere (``ctl
    explain`` asks; the pass itself calls :func:`_preempt` with what it has built)."""
    order = profile_order(m.spec.profiles)
    p = PassState(state, clock.epoch)
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
    p: PassState,
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


# -- 3. removed models ----------------------------------------------------------------------------


def _removed(state: ClusterState, cfg: Config, p: PassState) -> list[Decision]:
    """Stops for the running replicas of models no longer in the catalog."""
    gone = [
        r
        for model in state.replica_models()
        if model not in state.models
        for r in state.replicas_of(model)
        if r.active and r.id not in p.failed_now
    ]
    return [
        Stop(replica_id=r.id, reason=f"model {r.model} was removed", grace_s=cfg.stop_grace_s)
        for r in sorted(gone, key=lambda r: r.id)
    ]
