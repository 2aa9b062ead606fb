"""`ctl model headroom M` (SPEC SCHED-11): how many more replicas of a model fit now, where, and why
not more — by running the real scheduler pass on a copy of the state in which the model wants
many more, not by an estimate beside it. Models are taken in the pass's own order (by name), so
a model before this one that is short of its minimum takes its room first, as it would.

Stopped, parked or backing-off models are asked as if they were running, and say so: the question
is what the fleet has room for.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import msgspec

from llmgw.services.scheduler import autoscale as AS
from llmgw.services.scheduler.quota import stopped_at
from llmgw.services.scheduler.reconcile import reconcile
from llmgw.services.scheduler.state import ClusterState, ModelState, external_note
from llmgw.services.scheduler.vocabulary import Blocked, Clock, Config, Place

CAP = 256  # the most extra replicas asked for: "at least 256" is answer enough


def headroom(state: ClusterState, model: str, clock: Clock, cfg: Config, cap: int = CAP) -> dict[str, Any]:
    """Pure: ``state`` is not changed."""
    m = state.models.get(model)
    if m is None and (note := external_note(state, model)) is not None:
        return {"error": note}
    if m is None:
        known = ", ".join(sorted(state.models)) or "none"
        return {"error": f"no model named {model!r} (models: {known})"}
    current = sum(1 for r in state.replicas_of(model) if r.active)
    wanted = current + cap
    ghost_status = msgspec.structs.replace(m.status, min=wanted, max=wanted, stopped=False, parked=None)
    ghost = copy.copy(state)
    ghost.models = {
        **state.models,
        model: msgspec.structs.replace(m, status=ghost_status, starts=msgspec.structs.replace(m.starts, count=0)),
    }
    # What fits as the fleet stands: headroom never counts room that only taking others' replicas would make.
    decisions = reconcile(ghost, clock, msgspec.structs.replace(cfg, preempt=False))
    where: dict[str, int] = {}
    for d in decisions:
        if isinstance(d, Place) and d.model == model:
            where[d.node_id] = where.get(d.node_id, 0) + 1
    more = sum(where.values())
    blocked = next((d for d in decisions if isinstance(d, Blocked) and d.model == model), None)
    notes = []
    if m.stopped:
        notes.append("the model is stopped: this is the room it would have once started")
    if m.parked:
        notes.append(f"the model is parked ({m.parked}): this is the room it would have once retried")
    return {
        "model": model,
        "current": current,
        "one_more": one_more(state, m),
        "more": more,
        "at_least": more >= cap,
        "where": dict(sorted(where.items(), key=lambda item: (-item[1], item[0]))),
        # A capacity limit (SCHED-8) reads as where the answer stopped: "stopped at org:acme's capacity limit (…)".
        "why_not_more": (stopped_at(blocked.reason) or blocked.reason) if blocked is not None and more < cap else None,
        "notes": notes,
    }


def one_more(state: ClusterState, m: ModelState) -> dict[str, Any] | None:
    """What one more replica would serve by the model's saved measurement (SCHED-10), or None without one."""
    live = [r for r in state.replicas_of(m.name) if r.active]
    found = AS.measurement_of(m, live, [state.nodes[r.node_id].capacity for r in live if r.node_id in state.nodes])
    if found is None:
        return None
    when = datetime.fromtimestamp(found.at, UTC).strftime("%Y-%m-%d %H:%M UTC") if found.at is not None else "?"
    requests = "request" if found.concurrency == 1 else "requests"
    return {
        "concurrency": found.concurrency,
        "tokens_per_s": found.tokens_per_s,
        "measured_at": found.at,
        "profile": found.profile,
        "shape": found.shape.words() if found.shape is not None else None,
        "line": f"one more replica serves ~{found.concurrency} concurrent {requests}, ~{found.tokens_per_s:.0f} "
        f"tokens/s, by the measurement of {when}"
        + (f" (profile {found.profile}, {found.shape.words()})" if found.shape is not None else ""),
    }
