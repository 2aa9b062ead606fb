"""A model's lifecycle, folded once for every reader of the catalog (the scheduler, the routers, the
catalog service, the fleet projection): :func:`fold_model` over a model's events
(:data:`~llmgw.events.schema.models.MODEL_EVENTS`). Pure.
"""

from __future__ import annotations

import msgspec

from llmgw.events.schema.models import (
    ModelAdded,
    ModelAutoscaled,
    ModelChanged,
    ModelMeasured,
    ModelParked,
    ModelPreempted,
    ModelRemoved,
    ModelRetried,
    ModelScaled,
    ModelSpec,
    ModelStarted,
    ModelStopped,
    add_measurement,
)

GAVE_WAY_KEPT = 16  # a model's recent preemptions a fold keeps (holds last 5 minutes: more is history)


class ModelStatus(msgspec.Struct, kw_only=True):
    """A model as every reader of the catalog folds it: the scheduler, the routers and the catalog
    service add what only they need around this, so the lifecycle is decided in one place."""

    spec: ModelSpec
    declared: bool = False
    min: int = 1
    max: int = 1
    stopped: bool = False
    saved: tuple[int, int] | None = None  # the scaling a stop keeps for the start
    parked: str | None = None
    # Its recent preemptions (SCHED-7), newest last: one pass may make a model give way to several
    # winners, and each one's hold and earmark last until that winner is served (at most GAVE_WAY_KEPT).
    gave_way: list[ModelPreempted] = []
    preemptions: int = 0  # replicas it has given way, over its life
    autoscaled: int = 0  # replicas the load holds above the minimum (SCHED-9)
    autoscaled_at: float | None = None  # epoch of the last autoscaling step
    # What one replica serves (SCHED-10), the newest for each profile and node shape, newest last.
    measured: list[ModelMeasured] = []

    @property
    def preempted(self) -> ModelPreempted | None:
        """The last time it gave way."""
        return self.gave_way[-1] if self.gave_way else None


class ModelStatusView:
    """Read-through properties for a struct that holds a ``status: ModelStatus`` and adds its own
    fields around it (the scheduler's, the routers' and the catalog service's model records)."""

    __slots__ = ()
    status: ModelStatus

    @property
    def spec(self) -> ModelSpec:
        return self.status.spec

    @property
    def declared(self) -> bool:
        return self.status.declared

    @property
    def min(self) -> int:
        return self.status.min

    @property
    def max(self) -> int:
        return self.status.max

    @property
    def stopped(self) -> bool:
        return self.status.stopped

    @property
    def saved(self) -> tuple[int, int] | None:
        return self.status.saved

    @property
    def parked(self) -> str | None:
        return self.status.parked

    @property
    def preempted(self) -> ModelPreempted | None:
        return self.status.preempted

    @property
    def gave_way(self) -> list[ModelPreempted]:
        return self.status.gave_way


def fold_model(status: ModelStatus | None, payload: msgspec.Struct) -> ModelStatus | None:
    """The model after one of its events (None: not in the catalog). Pure."""
    if isinstance(payload, ModelAdded):
        s = payload.spec
        return ModelStatus(spec=s, declared=payload.declared, min=s.scaling.min, max=s.scaling.upper)
    if status is None or isinstance(payload, ModelRemoved):
        return None
    match payload:
        case ModelChanged():
            return msgspec.structs.replace(status, spec=payload.spec, parked=None)  # a new definition unparks
        case ModelScaled():
            return msgspec.structs.replace(status, min=payload.min, max=payload.max)
        case ModelStopped():  # a stop ends what the load had added: a start begins from the minimum
            return msgspec.structs.replace(
                status, stopped=True, saved=(payload.saved_min, payload.saved_max), autoscaled=0
            )
        case ModelStarted():
            return msgspec.structs.replace(status, stopped=False, min=payload.min, max=payload.max)
        case ModelParked():
            return msgspec.structs.replace(status, parked=payload.reason)
        case ModelRetried():
            return msgspec.structs.replace(status, parked=None)
        case ModelPreempted():
            return msgspec.structs.replace(
                status,
                gave_way=[*status.gave_way[-(GAVE_WAY_KEPT - 1) :], payload],
                preemptions=status.preemptions + len(payload.replicas),
            )
        case ModelAutoscaled():
            return msgspec.structs.replace(status, autoscaled=payload.added, autoscaled_at=payload.at)
        case ModelMeasured():
            return msgspec.structs.replace(status, measured=add_measurement(status.measured, payload))
    return status
