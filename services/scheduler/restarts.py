"""Restarts with surge (SPEC SCHED-6): a replica is replaced by a new copy first, then stopped.

A replica needs a restart when someone asked for one (`ctl restart`, folded as ``Replica.restart``)
or when it runs a stale definition of its model (its ``spec_hash`` is not the model's). Pure, one
step per model per pass, called by the reconcile pass once the model holds as many replicas as it
wants (a short model is placed up first; a scale-down comes first too):

1. a replacement is starting: nothing (the old replica serves meanwhile); it is ready: stop the old
   one with the normal grace, so the gateway drains it;
2. the old replica of the last restart still drains: nothing (its room is not free yet, and one at
   a time means one);
3. else the oldest ready replica that needs a restart gets a replacement, placed as any replica is,
   the old one's resources still held; where no second copy fits anywhere but one would fit in the
   old one's place, the old one stops (an outage, said so) and the normal pass places it again;
   where not even that fits, the old one keeps serving and the restart stays queued.

A replacement that fails to start leaves the old replica serving and the restart queued; its
failure counts towards the model's backoff and parking like any failed start.
"""

from __future__ import annotations

import msgspec

from llmgw.services.scheduler.pass_state import PassState
from llmgw.services.scheduler.placement import Candidate, cores_on, need_of, place, profile_order
from llmgw.services.scheduler.state import ClusterState, ModelState, ReplicaState
from llmgw.services.scheduler.vocabulary import Clock, Config, Decision, Place, Stop, backing_off


def surge(staying: list[ReplicaState]) -> set[str]:
    """Replacements whose old replica still runs: neither counted among the model's replicas (a
    scale-down would take them for extras) nor restarted themselves."""
    ids = {r.id for r in staying}
    return {r.id for r in staying if r.replaces and r.replaces in ids}


def needs_restart(r: ReplicaState, spec_hash: str) -> bool:
    return bool(r.restart) or r.spec_hash != spec_hash


def why_restart(r: ReplicaState, spec_hash: str) -> str:
    return "asked for" if r.restart else "stale profile" if r.spec_hash != spec_hash else "not needed"


def step(
    state: ClusterState,
    m: ModelState,
    staying: list[ReplicaState],
    replacements: list[ReplicaState],
    clock: Clock,
    cfg: Config,
    p: PassState,
) -> list[Decision]:
    """The next step of ``m``'s restarts. ``staying``: its running replicas off draining nodes, the
    ``replacements`` (see :func:`surge`) not among them."""
    for new in sorted(replacements, key=lambda r: r.id):
        if new.state != "ready":
            return []  # the replacement starts; the old one serves meanwhile
        reason = f"restarted: replaced by {new.id}"
        return [Stop(replica_id=new.replaces, reason=reason, grace_s=cfg.stop_grace_s)]
    if any(r.state == "draining" and r.restart for r in state.replicas_of(m.name)):
        return []  # the last restart's old replica still drains: one at a time
    due = sorted(
        (r for r in staying if r.state == "ready" and needs_restart(r, m.spec_hash)), key=lambda r: (r.placed_at, r.id)
    )
    if not m.spec.profiles:
        return []
    order = profile_order(m.spec.profiles)
    if due:
        old, why = due[0], why_restart(due[0], m.spec_hash)
    elif (back := _back_to_preferred(state, m, staying, p)) is not None:
        old, why, order = back  # only a profile it prefers is worth the move
    else:
        return []
    if (waiting := backing_off(m, clock, cfg)) is not None:
        return [waiting]
    needs = {k: need_of(m.spec.profiles[k]) for k in order}
    cs = p.candidates(m.name)
    seed = f"{m.name}/restart/{old.id}/{state.position}"
    for k in order:
        choice, verdicts = place(list(cs.values()), needs[k], seed)
        if choice is None:
            continue
        placed = msgspec.structs.replace(needs[k], cores=cores_on(needs[k], cs[choice.node_id].cpus))
        if p.quota.admit(m.name, placed) is not None:  # SCHED-8: a second copy would take its owner over its limit
            continue
        p.reserve(choice.node_id, placed, choice.gpus)
        fitting = sum(1 for v in verdicts if v.fits)
        why = f"replaces {old.id} ({why}); best of {fitting} fitting nodes"
        if len(order) > 1:
            why += f"; profile {m.spec.profiles[k].name}"
        return [
            Place(
                model=m.name,
                node_id=choice.node_id,
                gpus=choice.gpus,
                need=placed,
                why=why,
                profile=k,
                replaces=old.id,
            )
        ]
    if not due:
        return []  # moving back to a preferred profile is never worth an outage
    # No second copy fits anywhere. Would one fit in the old one's place?
    freed = dict(cs)
    if old.node_id in freed:
        freed[old.node_id] = _without(freed[old.node_id], old)
    if not any(place(list(freed.values()), needs[k], seed)[0] for k in order):
        return []  # not even there: the old one keeps serving, its restart queued
    reason = f"restart of {old.id}: no room for a second copy; model {m.name} is short until it is back"
    return [Stop(replica_id=old.id, reason=reason, grace_s=cfg.stop_grace_s, short=True)]


def _back_to_preferred(
    state: ClusterState, m: ModelState, staying: list[ReplicaState], p: PassState
) -> tuple[ReplicaState, str, list[int]] | None:
    """The oldest ready replica running a fallback profile while a profile the model prefers fits now
    somewhere (CAT-2), with the reason it moves and the profiles it prefers (in order); None when
    there is none. It moves back with surge, like any restart: the preferred copy first, then the
    fallback one stops."""
    profiles = m.spec.profiles
    if len(profiles) < 2:
        return None
    order = profile_order(profiles)
    for r in sorted((r for r in staying if r.state == "ready"), key=lambda r: (r.placed_at, r.id)):
        if r.profile not in profiles:
            continue  # a definition since edited: the stale-profile rule restarts it
        rank = order.index(profiles.index(r.profile))
        if rank == 0:
            continue
        cs = list(p.candidates(m.name).values())
        for k in order[:rank]:
            if place(cs, need_of(profiles[k]), f"{m.name}/back/{r.id}")[0] is not None:
                return r, f"on fallback profile {r.profile.name}; preferred {profiles[k].name} fits again", order[:rank]
    return None


def _without(c: Candidate, r: ReplicaState) -> Candidate:
    """``c`` as it would be with ``r`` gone: its reservation released."""
    return msgspec.structs.replace(
        c,
        reserved_cores=max(c.reserved_cores - r.cores, 0),
        reserved_memory_bytes=max(c.reserved_memory_bytes - r.memory_bytes, 0),
        reserved_gpus=[g for g in c.reserved_gpus if g not in r.gpus],
        model_replicas=max(c.model_replicas - 1, 0),
        replicas=max(c.replicas - 1, 0),
    )
