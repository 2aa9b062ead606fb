"""`ctl explain MODEL` (SPEC SCHED-3): what the model wants, what it has, and node by node what each lacks."""

from __future__ import annotations

from typing import Any

from llmgw.services.scheduler import preemption as PRE
from llmgw.services.scheduler.candidates import candidates
from llmgw.services.scheduler.placement import evaluate, need_of, profile_order
from llmgw.services.scheduler.quota import Ledger, owner_problem
from llmgw.services.scheduler.reconcile import held_back, try_preempt
from llmgw.services.scheduler.state import ClusterState, external_note
from llmgw.services.scheduler.vocabulary import Clock, Config, Preempt, Waiting


def explain(
    state: ClusterState, model: str, cfg: Config, leader: str | None = None, clock: Clock | None = None
) -> dict[str, Any]:
    """Pure. ``clock``: what preemption and holds are judged at (without one, they are not explained)."""
    m = state.models.get(model)
    if m is None and (note := external_note(state, model)) is not None:
        return {"error": note}
    if m is None:
        known = ", ".join(sorted(state.models)) or "none"
        return {"error": f"no model named {model!r} (models: {known})"}
    replicas = [
        {"id": r.id, "node": r.node_id, "state": r.state, "reason": r.reason, "profile": r.profile.name}
        for r in sorted(state.replicas_of(model), key=lambda r: r.placed_at)
        if r.active or r.state == "draining"
    ]
    body: dict[str, Any] = {
        "model": model,
        "min": m.min,
        "max": m.max,
        "stopped": m.stopped,
        "parked": m.parked,
        "failures": m.failures,
        "last_error": m.last_error,
        "replicas": replicas,
        "answered_by": leader,
        "capacity_class": m.spec.capacity_class or f"default ({PRE.class_of(m.spec, m.min)})",
        "owner": m.spec.owner,
    }
    if (problem := owner_problem(state, m.spec.owner)) is not None:
        body["owner_note"] = problem
    if m.max > m.min or m.status.autoscaled:  # SCHED-9: what the load added, and the load now
        load = state.load.get(model)
        latest = load.samples[-1] if load is not None and load.samples else None
        body["autoscaling"] = {
            "added": m.status.autoscaled,
            "last_step_at": m.status.autoscaled_at,
            "load": None
            if latest is None
            else {"waiting": latest.waiting, "running": latest.running, "ready": latest.ready, "slots": latest.slots},
        }
    if not m.spec.profiles:
        body["nodes"] = []
        body["summary"] = "the model has no profile to place"
        return body
    # Node by node for the profile the next replica would run: the first, in order of preference, that fits.
    cs = list(candidates(state, model).values())
    tried = []
    for k in profile_order(m.spec.profiles):
        profile = m.spec.profiles[k]
        need = need_of(profile)
        verdicts = evaluate(cs, need)
        fitting = sum(1 for v in verdicts if v.fits)
        tried.append({"profile": profile.name, "engine": profile.engine, "fitting_nodes": fitting})
        if fitting:
            break
    body["profiles"] = tried  # in order of preference, up to the one that fits
    body["needs"] = {
        "profile": profile.name,
        "engine": need.engine,
        "cores": need.cores or ("half a node's CPUs (the threads rule)" if need.engine == "llamacpp" else 0),
        "memory_gb": round(need.memory_bytes / 1024**3, 2),
        "gpus": need.gpus,
        "node_selector": need.node_selector,
    }
    body["nodes"] = [{"node": v.node_id, "fits": v.fits, "lacks": v.reasons, "score": v.score} for v in verdicts]
    limit = Ledger(state).block_all(model, [need_of(m.spec.profiles[k]) for k in profile_order(m.spec.profiles)])
    if limit is not None:
        body["quota"] = limit  # SCHED-8: no more replicas, whatever the nodes have
    if m.stopped:
        body["summary"] = "stopped by an administrator: `llmgw ctl model start` runs it again"
    elif m.parked:
        body["summary"] = f"parked: {m.parked}; fix the cause, then `llmgw ctl retry {model}`"
    elif limit is not None:
        body["summary"] = (
            f"{limit}: no more replicas until it holds less or its limit is raised (`llmgw ctl quota list`)"
        )
    elif not verdicts:
        body["summary"] = "no nodes have registered"
    else:
        body["summary"] = f"{fitting} of {len(verdicts)} nodes could take another replica"
        if clock is not None and (held := held_back(state, m, clock)) is not None:
            body["summary"] += f"; it {held.why} and is held back until that model is placed or the hold ends"
        elif clock is not None and not fitting and cfg.preempt:
            body["preemption"] = _preemption(state, m, cfg, clock)
            body["summary"] += f"; {body['preemption']}"
    return body


def _preemption(state: ClusterState, m: Any, cfg: Config, clock: Clock) -> str:
    """What the next pass's preemption would do for one more replica of ``m`` (SCHED-7), in words."""
    have = sum(1 for r in state.replicas_of(m.name) if r.active)
    decisions = try_preempt(state, m, have, clock, cfg)
    if (wait := next((d for d in decisions if isinstance(d, Waiting)), None)) is not None:
        return wait.why
    taken = [d for d in decisions if isinstance(d, Preempt)]
    if taken:
        return "; ".join(f"{', '.join(d.replicas)} of {d.model} would give way: {d.reason}" for d in taken)
    cls = PRE.class_of(m.spec, m.min)
    return (
        f"nothing may give way to a {cls} model: no replica of a lower class"
        + (", nor an extra of its own class," if have < m.min else "")
        + f" older than {cfg.preempt_min_age_s / 60:g} minutes and outside other scopes' guarantees"
        + " makes room on any node"
    )
