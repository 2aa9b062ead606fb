"""Autoscaling (SPEC SCHED-9): the replicas a model holds follow its load, between min and max.

Pure. The load is what the engines say in the heartbeats (requests running and waiting on each
ready replica, ``events/schema/nodes.py`` ``ReplicaReport``), folded by the scheduler into a short
series per model (``load.py``): an observation of this process, like the routers' demand, not an
event. What must survive a leader change — how many replicas the load added, when the last step
was — is the ``model.autoscaled`` event, folded by ``fold_model``.

The rules, without a measurement of the model (SCHED-10 not saved):

- **up**: at least ``scale_up_waiting_per_replica`` waiting requests per ready replica, held for
  ``scale_up_after_s`` — on average over that window, at the replicas ready now, with requests still
  waiting at its end — adds one replica (the engines' queues are noisy: one sample below the line
  must not restart the minute while the queue grows);
- **down**: ``scale_down_after_s`` with nothing waiting removes one replica the load added, and only
  when the requests running at the busiest moment of that window fit in the other replicas' slots
  under ``scale_down_below`` of them (else a steady load at the threshold would flap: remove, wait,
  add, …);
- one step at a time: never while a replica of the model is still starting, and a hold or an idle
  window counts from the last step.

With a measurement (:class:`Measurement`, saved by ``ctl bench --save``, :func:`measurement_of`), the trigger is
SCHED-9's second sentence: up when requests per ready replica pass the concurrency one replica serves
within the SLO; down only if the rest stay under ``scale_down_below`` of the measured capacity.

A step is the :class:`~llmgw.services.scheduler.vocabulary.Autoscale` decision, which :func:`adjust` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.services.scheduler.load import LoadSample, ModelLoad
from llmgw.services.scheduler.state import ModelState, ReplicaState
from llmgw.services.scheduler.vocabulary import Autoscale, Clock, Config


class Measurement(msgspec.Struct, frozen=True, kw_only=True):
    """SCHED-10's saved measurement of a model (``model.measured``, `ctl bench --save`): the most
    concurrent requests one replica serves within the model's SLO, and its tokens/s there."""

    concurrency: int
    tokens_per_s: float = 0.0
    at: float | None = None  # when it was measured (epoch seconds)
    profile: str = ""
    shape: M.NodeShape | None = None


def measurement_of(
    m: ModelState, live: Sequence[ReplicaState] = (), nodes: Sequence[N.NodeCapacity | None] = ()
) -> Measurement | None:
    """The saved measurement the thresholds follow (SCHED-10): of the profile the model's ``live``
    replicas run (its first profile when none runs), on the shape of their ``nodes`` when one was
    measured there, else the newest of that profile; None without one. A measurement taken against
    another SLO than the model's now says nothing of this one, and does not count."""
    profiles = {r.profile.name for r in live} or {p.name for p in m.spec.profiles[:1]}
    usable = [x for x in m.status.measured if x.profile in profiles and x.slo == m.spec.slo]
    shapes = {M.node_shape(n.cpus, [g.name for g in n.gpus]) for n in nodes if n is not None}
    found = next((x for x in reversed(usable) if x.shape in shapes), usable[-1] if usable else None)
    if found is None:
        return None
    return Measurement(
        concurrency=found.concurrency,
        tokens_per_s=found.tokens_per_s,
        at=found.at,
        profile=found.profile,
        shape=found.shape,
    )


def _pressure(s: LoadSample, measured: Measurement | None) -> float:
    """What the up rule weighs per ready replica: requests waiting, or (measured) requests in all."""
    return (s.waiting if measured is None else s.running + s.waiting) / s.ready


def _mean_over(
    samples: list[LoadSample], start: float, now: float, ready: int, measured: Measurement | None
) -> float | None:
    """The time-weighted mean of :func:`_pressure` over ``[start, now]``; None unless the samples cover
    it at ``ready`` ready replicas or more throughout (a window that began before the last addition
    was ready, or before this process heard of the model, does not count)."""
    inside = [s for s in samples if s.at > start]
    before = [s for s in samples if s.at <= start][-1:]
    if not before:
        return None
    window = [*before, *inside]
    if any(s.ready < ready for s in window) or now <= start:
        return None
    total = 0.0
    for k, s in enumerate(window):
        begin = max(s.at, start)
        end = window[k + 1].at if k + 1 < len(window) else now
        total += _pressure(s, measured) * max(end - begin, 0.0)
    return total / (now - start)


def adjust(
    m: ModelState,
    lower: int,
    upper: int,
    live: list[ReplicaState],
    load: ModelLoad | None,
    clock: Clock,
    cfg: Config,
    measured: Measurement | None = None,
) -> tuple[int, int, Autoscale | None]:
    """(lower, upper, step): the replicas the model holds now with its load, and the step that moves
    it, if one is due. ``lower``/``upper`` are what it holds without autoscaling (min, or an on-demand
    model's one while used) and its max; ``live`` its active replicas outside restarts and drains.

    A step down returns ``upper`` equal to the new count, so that the pass stops one replica."""
    added = m.status.autoscaled
    if upper <= lower:  # no room above the minimum (max = min, or an idle on-demand model)
        if added:
            step = Autoscale(
                model=m.name,
                from_=lower + added,
                to=lower,
                added=0,
                reason=f"max {upper} leaves no room above min {lower}" if upper else "idle on-demand model",
                at=clock.epoch,
            )
            return lower, upper, step
        return lower, upper, None
    target = min(lower + added, upper)
    if (
        load is None
        or not load.samples
        or load.seen_at is None
        or clock.monotonic - load.seen_at > cfg.lost_after_s  # the engines' nodes fell silent: no signal
        or any(r.state != "ready" for r in live)
    ):
        return target, upper, None  # no signal yet, or a step (or a start) is still under way
    ready = len(live)
    offset = clock.epoch - clock.monotonic  # the step's epoch on this process's monotonic clock
    step_at = m.status.autoscaled_at - offset if m.status.autoscaled_at is not None else float("-inf")
    now = clock.monotonic
    newest = load.samples[-1]
    if target < upper and ready >= target:
        # A queue held for the window: on average over it (a sample's noise neither makes nor breaks it),
        # and still there now (a burst that ended does not count).
        start = max(now - cfg.scale_up_after_s, step_at)
        mean = _mean_over(load.samples, start, now, ready, measured) if now - start >= cfg.scale_up_after_s else None
        line = cfg.scale_up_waiting_per_replica if measured is None else measured.concurrency
        now_pressing = newest.waiting > 0 if measured is None else _pressure(newest, measured) > line
        over = mean is not None and (mean >= line if measured is None else mean > line)
        if over and now_pressing and mean is not None:
            held = now - start
            if measured is not None:
                why = (
                    f"{newest.running + newest.waiting} requests on {newest.ready} ready "
                    f"{_replicas(newest.ready)}, {mean:.1f} a replica on average over {held:.0f} s, above the "
                    f"{measured.concurrency} one replica serves within its SLO"
                )
            else:
                why = (
                    f"{newest.waiting} requests waiting on {newest.ready} ready {_replicas(newest.ready)}, "
                    f"{mean:.1f} a replica on average over {held:.0f} s"
                )
            return (
                target + 1,
                upper,
                Autoscale(
                    model=m.name, from_=target, to=target + 1, added=target + 1 - lower, reason=why, at=clock.epoch
                ),
            )
    if added > 0 and target > lower:
        # Nothing waiting since the later of the last busy sample and the last step.
        quiet = load.samples[0].at
        for i in range(len(load.samples) - 1, -1, -1):
            if load.samples[i].waiting > 0:
                quiet = load.samples[i + 1].at if i + 1 < len(load.samples) else now
                break
        quiet = max(quiet, step_at)
        if now - quiet >= cfg.scale_down_after_s:
            # The busiest moment of the last window: its samples, and the one that held at its start.
            start = now - cfg.scale_down_after_s
            window = [*[s for s in load.samples if s.at <= start][-1:], *[s for s in load.samples if s.at > start]]
            peak = max(s.running + s.waiting for s in window)
            per_replica = _capacity_per_replica(window, measured)
            rest = target - 1
            if per_replica is not None and peak > cfg.scale_down_below * per_replica * rest:
                return target, upper, None  # the rest would be busy past the line: a steady load stays
            load_words = f"at most {peak} running on {newest.ready} ready {_replicas(newest.ready)}"
            why = f"nothing waiting for {now - quiet:.0f} s; {load_words}"
            return (
                target - 1,
                target - 1,
                Autoscale(
                    model=m.name, from_=target, to=target - 1, added=target - 1 - lower, reason=why, at=clock.epoch
                ),
            )
    return target, upper, None


def _capacity_per_replica(window: list[LoadSample], measured: Measurement | None) -> float | None:
    """Requests one replica serves: the measurement's concurrency, else the engines' slots."""
    if measured is not None:
        return float(measured.concurrency)
    known = [s.slots / s.ready for s in window if s.slots is not None and s.ready > 0]
    return min(known) if known else None


def _replicas(n: int) -> str:
    return "replica" if n == 1 else "replicas"
