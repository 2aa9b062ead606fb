"""What the scheduler knows of the fleet, as Prometheus series (SPEC OBS-1).

Only the leader publishes model and node series: every scheduler folds the same cluster, and two
publishing would double every sum. A standby publishes ``llmgw_control_plane_leader`` 0, so
``sum(llmgw_control_plane_leader) != 1`` says the control plane has no leader, or two.

The figures are a pure function of the folded state and the last pass's decisions
(:func:`fleet_figures`); :class:`SchedulerMetrics` only sets gauges from them and drops the
series of models that are gone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import msgspec
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily

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


# -- each node's latest heartbeat -----------------------------------------------------------------

# name -> (help, label names); the values come from :func:`node_samples`
NODE_SERIES = {
    "llmgw_node_memory_total_bytes": ("Memory of the node", ("node",)),
    "llmgw_node_memory_available_bytes": ("Memory the node has available", ("node",)),
    "llmgw_node_disk_free_bytes": ("Free disk under the agent's data directory", ("node",)),
    "llmgw_node_temperature_celsius": ("A hwmon temperature sensor", ("node", "sensor")),
    "llmgw_node_power_watts": ("Package power from RAPL", ("node", "zone")),
    "llmgw_gpu_memory_total_bytes": ("GPU memory", ("node", "gpu")),
    "llmgw_gpu_memory_used_bytes": ("GPU memory in use", ("node", "gpu")),
    "llmgw_gpu_temperature_celsius": ("GPU temperature", ("node", "gpu")),
    "llmgw_gpu_memory_temperature_celsius": ("GPU memory temperature", ("node", "gpu")),
    "llmgw_gpu_power_watts": ("GPU power draw", ("node", "gpu")),
    "llmgw_gpu_power_limit_watts": ("GPU power limit", ("node", "gpu")),
    "llmgw_gpu_throttled": ("1 for each reason the GPU is throttled now", ("node", "gpu", "reason")),
}
MB = 1024 * 1024


def node_samples(state: ClusterState) -> list[tuple[str, tuple[str, ...], float]]:
    """(series, label values, value) from each registered, not lost node's latest heartbeat. A
    sensor the node lacks is absent, never 0 (FLEET-3). Pure."""
    out: list[tuple[str, tuple[str, ...], float]] = []
    for node_id, n in sorted(state.nodes.items()):
        hb = n.heartbeat
        if hb is None or n.lost:
            continue
        for name, value in (
            ("llmgw_node_memory_total_bytes", hb.memory_total_bytes),
            ("llmgw_node_memory_available_bytes", hb.memory_available_bytes),
            ("llmgw_node_disk_free_bytes", hb.disk_free_bytes),
        ):
            if value is not None:
                out.append((name, (node_id,), float(value)))
        for key, value in sorted(hb.sensors.items()):
            kind, _, rest = key.partition(".")
            if kind == "temp":
                out.append(("llmgw_node_temperature_celsius", (node_id, rest), value))
            elif kind == "power":
                out.append(("llmgw_node_power_watts", (node_id, rest.removesuffix("_w")), value))
        for g in hb.gpus:
            gpu = str(g.index)
            out.append(("llmgw_gpu_memory_total_bytes", (node_id, gpu), float(g.memory_total_mb * MB)))
            for name, value in (
                ("llmgw_gpu_memory_used_bytes", None if g.memory_used_mb is None else g.memory_used_mb * MB),
                ("llmgw_gpu_temperature_celsius", g.temperature_c),
                ("llmgw_gpu_memory_temperature_celsius", g.memory_temperature_c),
                ("llmgw_gpu_power_watts", g.power_w),
                ("llmgw_gpu_power_limit_watts", g.power_limit_w),
            ):
                if value is not None:
                    out.append((name, (node_id, gpu), float(value)))
            for reason in g.throttle:
                out.append(("llmgw_gpu_throttled", (node_id, gpu, reason), 1.0))
    return out


class NodeCollector:
    """The nodes' latest heartbeats as series, computed when scraped and only while ``leads()``."""

    def __init__(self, state: Callable[[], ClusterState], leads: Callable[[], bool]) -> None:
        self.state = state
        self.leads = leads

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # the families are made at scrape time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if not self.leads():
            return
        families = {
            name: GaugeMetricFamily(name, text, labels=list(labels)) for name, (text, labels) in NODE_SERIES.items()
        }
        for name, labels, value in node_samples(self.state()):
            families[name].add_metric(list(labels), value)
        yield from families.values()
