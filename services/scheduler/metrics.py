"""What the scheduler knows of the fleet, as Prometheus series (SPEC OBS-1).

Only the leader publishes model and node series: every scheduler folds the same cluster, and two
publishing would double every sum. A standby publishes ``llmgw_control_plane_leader`` 0, so
``sum(llmgw_control_plane_leader) != 1`` says the control plane has no leader, or two.

The figures are a pure function of the folded state and the last pass's decisions
(:func:`fleet_figures`); :class:`SchedulerMetrics` only sets gauges from them and drops the
series of models that are gone.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from prometheus_client import CollectorRegistry, Gauge

from llmgw.services.scheduler.reconcile import Config, wanted_replicas
from llmgw.services.scheduler.state import ClusterState

NODE_STATES = ("ready", "cordoned", "lost")


class ModelFigures(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    ready: int  # replicas ready to serve
    desired: int  # replicas it should hold now (0 when stopped, or on demand and idle)
    start_failures: int  # consecutive failed starts since the last ready replica or edit
    parked: bool
    unplaceable: bool  # the last pass found no node for a wanted replica


class FleetFigures(msgspec.Struct, frozen=True, kw_only=True):
    models: list[ModelFigures]
    nodes: dict[str, int]  # NODE_STATES -> how many registered nodes are in it


def fleet_figures(state: ClusterState, now_epoch: float, cfg: Config, blocked: Iterable[str]) -> FleetFigures:
    """The figures of every model in the catalog and of the nodes. Pure."""
    blocked = set(blocked)
    models = []
    for name, m in sorted(state.models.items()):
        ready = sum(1 for r in state.replicas_of(name) if r.state == "ready")
        desired = 0 if m.stopped else wanted_replicas(m, state.demand.get(name), now_epoch, cfg)[0]
        models.append(
            ModelFigures(
                model=name,
                ready=ready,
                desired=desired,
                start_failures=m.failures,
                parked=m.parked is not None,
                unplaceable=name in blocked,
            )
        )
    nodes = dict.fromkeys(NODE_STATES, 0)
    for n in state.nodes.values():
        if not n.registered:
            continue
        nodes["lost" if n.lost else "cordoned" if n.cordoned else "ready"] += 1
    return FleetFigures(models=models, nodes=nodes)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry, instance: str) -> None:
        r = registry
        self.instance = instance
        model = ["model"]
        self.ready = Gauge(
            "llmgw_model_replicas_ready",
            "Ready replicas (0 for a model that should run and has none)",
            model,
            registry=r,
        )
        self.desired = Gauge("llmgw_model_replicas_desired", "Replicas the model should hold now", model, registry=r)
        self.failures = Gauge(
            "llmgw_model_start_failures", "Consecutive failed starts since the last ready replica", model, registry=r
        )
        self.parked = Gauge("llmgw_model_parked", "1 while the model is parked after failed starts", model, registry=r)
        self.unplaceable = Gauge(
            "llmgw_model_unplaceable", "1 while no node can take a replica the model wants", model, registry=r
        )
        self.nodes = Gauge("llmgw_nodes", "Registered nodes by state (ready, cordoned, lost)", ["state"], registry=r)
        self.leader = Gauge(
            "llmgw_control_plane_leader", "1 while this scheduler instance leads, else 0", ["instance"], registry=r
        )
        self._models: set[str] = set()
        self.leader.labels(instance=instance).set(0)

    def leading(self, leads: bool) -> None:
        self.leader.labels(instance=self.instance).set(1 if leads else 0)
        if not leads:
            self.clear()

    def publish(self, figures: FleetFigures) -> None:
        seen = set()
        for f in figures.models:
            seen.add(f.model)
            self.ready.labels(model=f.model).set(f.ready)
            self.desired.labels(model=f.model).set(f.desired)
            self.failures.labels(model=f.model).set(f.start_failures)
            self.parked.labels(model=f.model).set(1 if f.parked else 0)
            self.unplaceable.labels(model=f.model).set(1 if f.unplaceable else 0)
        for gone in self._models - seen:
            self._remove(gone)
        self._models = seen
        for state, count in figures.nodes.items():
            self.nodes.labels(state=state).set(count)

    def clear(self) -> None:
        """Drop every model and node series (this instance no longer leads)."""
        for name in self._models:
            self._remove(name)
        self._models = set()
        self.nodes.clear()

    def _remove(self, model: str) -> None:
        for g in (self.ready, self.desired, self.failures, self.parked, self.unplaceable):
            try:
                g.remove(model)
            except KeyError:
                pass
