"""The engines' load per model (SPEC SCHED-9), as the scheduler keeps it: a short step series.

What the heartbeats say (requests running and waiting on each ready replica) and what the routers'
queues say is summed per model by :class:`~llmgw.services.scheduler.state.ClusterState` and folded
here into a :class:`ModelLoad`. It is an observation of this process, like the routers' demand, not
an event: a new leader starts with no load and waits for the next heartbeats. The autoscaling rules
(``autoscale.py``) read it.
"""

from __future__ import annotations

import msgspec

KEEP_S = 1800.0  # load kept per model: longer than any idle window worth configuring
KEEP_SAMPLES = 4096  # and at most this many changes of it


class LoadSample(msgspec.Struct, frozen=True, kw_only=True):
    """A model's load from ``at`` (this process's monotonic seconds) until the next sample: the sum
    over the ready replicas whose engines answered their metrics."""

    at: float
    waiting: int
    running: int
    ready: int
    slots: int | None = None  # the concurrent requests those replicas serve; None where one did not say


class ModelLoad(msgspec.Struct, kw_only=True):
    """A model's load as a step function: a sample is kept only when the load changes."""

    samples: list[LoadSample] = []
    seen_at: float | None = None  # the last heartbeat that said anything of the model


def fold_load(load: ModelLoad | None, sample: LoadSample) -> ModelLoad:
    """``load`` with ``sample`` added: a sample equal to the last in all but time moves only ``seen_at``;
    samples older than :data:`KEEP_S` go, but the newest before that line stays (it holds until the next)."""
    load = load or ModelLoad()
    load.seen_at = sample.at
    last = load.samples[-1] if load.samples else None
    if last is not None and (last.waiting, last.running, last.ready, last.slots) == (
        sample.waiting,
        sample.running,
        sample.ready,
        sample.slots,
    ):
        return load
    load.samples.append(sample)
    cut = 0
    while cut + 1 < len(load.samples) and (
        load.samples[cut + 1].at <= sample.at - KEEP_S or len(load.samples) - cut > KEEP_SAMPLES
    ):
        cut += 1
    if cut:
        del load.samples[:cut]
    return load
