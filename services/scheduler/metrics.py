"""What the scheduler knows of the fleet, as Prometheus series (SPEC OBS-1).

Only the leader yields model and node series: every scheduler folds the same cluster, and two
publishing would double every sum. A standby yields ``llmgw_control_plane_leader`` 0, so
``sum(llmgw_control_plane_leader) != 1`` says the control plane has no leader, or two.

The figures are pure functions of the folded state and the last pass's blocked models
(:func:`fleet_figures`, :func:`node_samples`); :class:`FleetCollector` turns them into series when
Prometheus scrapes, so nothing is set on the scheduler's passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmgw.services.scheduler import autoscale as AS
from llmgw.services.scheduler.preemption import class_of
from llmgw.services.scheduler.quota import CAPACITY_SERIES, capacity_samples
from llmgw.services.scheduler.reconcile import wanted_replicas
from llmgw.services.scheduler.state import ClusterState
from llmgw.services.scheduler.vocabulary import Config

NODE_STATES = ("ready", "cordoned", "lost")


class ModelFigures(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    ready: int  # replicas ready to serve
    desired: int  # replicas it should hold now (0 when stopped, or on demand and idle)
    start_failures: int  # consecutive failed starts since the last ready replica or edit
    parked: bool
    unplaceable: bool  # the last pass found no node for a wanted replica
    autoscaled: int = 0  # replicas its load holds above the minimum (SCHED-9)
    requests_running: int | None = None  # its engines' load as the heartbeats last said
    requests_waiting: int | None = None
    measured_concurrency: int | None = None  # what one replica serves by the measurement it follows (SCHED-10)
    measured_tokens_per_s: float | None = None


class FleetFigures(msgspec.Struct, frozen=True, kw_only=True):
    models: list[ModelFigures]
    nodes: dict[str, int]  # NODE_STATES -> how many registered nodes are in it


def fleet_figures(state: ClusterState, now_epoch: float, cfg: Config, blocked: Iterable[str]) -> FleetFigures:
    """The figures of every model in the catalog and of the nodes. Pure."""
    blocked = set(blocked)
    models = []
    for name, m in sorted(state.models.items()):
        ready = sum(1 for r in state.replicas_of(name) if r.state == "ready")
        lower, upper = wanted_replicas(m, state.demand.get(name), now_epoch, cfg)
        desired = 0 if m.stopped else min(lower + m.status.autoscaled, upper) if upper > lower else lower
        load = state.load.get(name)
        latest = load.samples[-1] if load is not None and load.samples else None
        live = [r for r in state.replicas_of(name) if r.active]
        measured = AS.measurement_of(
            m, live, [state.nodes[r.node_id].capacity for r in live if r.node_id in state.nodes]
        )
        models.append(
            ModelFigures(
                model=name,
                ready=ready,
                desired=desired,
                start_failures=m.failures,
                parked=m.parked is not None,
                unplaceable=name in blocked,
                autoscaled=m.status.autoscaled,
                requests_running=latest.running if latest else None,
                requests_waiting=latest.waiting if latest else None,
                measured_concurrency=measured.concurrency if measured else None,
                measured_tokens_per_s=measured.tokens_per_s if measured else None,
            )
        )
    nodes = dict.fromkeys(NODE_STATES, 0)
    for n in state.nodes.values():
        if not n.registered:
            continue
        nodes["lost" if n.lost else "cordoned" if n.cordoned else "ready"] += 1
    return FleetFigures(models=models, nodes=nodes)


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


MODEL_SERIES = {
    "llmgw_model_replicas_ready": "Ready replicas (0 for a model that should run and has none)",
    "llmgw_model_replicas_desired": "Replicas the model should hold now",
    "llmgw_model_start_failures": "Consecutive failed starts since the last ready replica",
    "llmgw_model_parked": "1 while the model is parked after failed starts",
    "llmgw_model_unplaceable": "1 while the last pass found no node for a replica the model wants",
    "llmgw_model_replicas_autoscaled": "Replicas the model's load holds above its minimum (SCHED-9)",
    "llmgw_model_requests_running": "Requests its ready engines run, as their metrics last said",
    "llmgw_model_requests_waiting": "Requests waiting for a slot on its ready engines, as their metrics last said",
    "llmgw_model_measured_concurrency": "Concurrent requests one replica serves within the SLO, by the measurement "
    "autoscaling follows (SCHED-10)",
    "llmgw_model_measured_tokens_per_second": "Tokens/s one replica serves at that concurrency, by the measurement",
}


class FleetCollector:
    """Every series here, computed from the folded state when scraped: nothing is kept between
    scrapes, so a removed model's series simply stop. A standby yields only that it does not lead."""

    def __init__(
        self,
        instance: str,
        state: Callable[[], ClusterState],
        leads: Callable[[], bool],
        blocked: Callable[[], Iterable[str]],
        cfg: Config,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.instance = instance
        self.state, self.leads, self.blocked, self.cfg, self.now = state, leads, blocked, cfg, now

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # the families are made at scrape time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        leads = self.leads()
        leader = GaugeMetricFamily(
            "llmgw_control_plane_leader", "1 while this scheduler instance leads, else 0", labels=["instance"]
        )
        leader.add_metric([self.instance], 1.0 if leads else 0.0)
        yield leader
        if not leads:
            return
        state = self.state()
        figures = fleet_figures(state, self.now(), self.cfg, self.blocked())
        models = {name: GaugeMetricFamily(name, text, labels=["model"]) for name, text in MODEL_SERIES.items()}
        for f in figures.models:
            for name, value in (
                ("llmgw_model_replicas_ready", f.ready),
                ("llmgw_model_replicas_desired", f.desired),
                ("llmgw_model_start_failures", f.start_failures),
                ("llmgw_model_parked", int(f.parked)),
                ("llmgw_model_unplaceable", int(f.unplaceable)),
                ("llmgw_model_replicas_autoscaled", f.autoscaled),
                ("llmgw_model_requests_running", f.requests_running),
                ("llmgw_model_requests_waiting", f.requests_waiting),
                ("llmgw_model_measured_concurrency", f.measured_concurrency),
                ("llmgw_model_measured_tokens_per_second", f.measured_tokens_per_s),
            ):
                if value is not None:  # no engine has said its load: no series, never 0
                    models[name].add_metric([f.model], float(value))
        yield from models.values()
        # Folded from the log (each model.preempted counts its replicas), so a new leader counts on
        # from where the last one stopped.
        preempted = CounterMetricFamily(
            "llmgw_model_preempted",
            "Replicas of the model that gave way to another (SCHED-7)",
            labels=["model", "class"],
        )
        for name, m in sorted(state.models.items()):
            preempted.add_metric([name, class_of(m.spec, m.min)], float(m.status.preemptions))
        yield preempted
        nodes = GaugeMetricFamily("llmgw_nodes", "Registered nodes by state (ready, cordoned, lost)", labels=["state"])
        for node_state, count in figures.nodes.items():
            nodes.add_metric([node_state], float(count))
        yield nodes
        per_node = {
            name: GaugeMetricFamily(name, text, labels=list(labels)) for name, (text, labels) in NODE_SERIES.items()
        }
        for name, labels, value in node_samples(state):
            per_node[name].add_metric(list(labels), value)
        yield from per_node.values()
        # Capacity quotas (SCHED-8): holdings beside each scope's guarantee and limit.
        capacity = {
            name: GaugeMetricFamily(name, text, labels=["scope", "resource"]) for name, text in CAPACITY_SERIES.items()
        }
        for name, labels, value in capacity_samples(state):
            capacity[name].add_metric(list(labels), value)
        yield from capacity.values()
