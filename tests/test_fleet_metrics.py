"""The fleet as Prometheus series (SPEC OBS-1) and the alerts over them (OBS-2)."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from llmgw.cli.log_sink import DroppedLinesCollector
from llmgw.events.runtime.metrics import StoreMetrics
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.infra.pki import CertificateExpiry
from llmgw.projections.metrics import ProjectionMetrics
from llmgw.services.backup.service import BackupMetrics
from llmgw.services.router.metrics import PoolSaturation, QueueDepth, RouterMetrics, UsageMetrics, pool_loads
from llmgw.services.scheduler.metrics import NODE_SERIES, FleetCollector, fleet_figures, node_samples
from llmgw.services.scheduler.state import ClusterState
from llmgw.services.scheduler.vocabulary import Blocked
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.scheduler_world import CFG, CPU_16C_64G, T0, World, model, node, on_model, on_node, placed, ready, shaped
from tests.support import wait_until

ALERTS = Path(__file__).resolve().parent.parent / "ops" / "prometheus" / "alerts.yml"


def test_each_model_s_figures_say_what_runs_what_should_and_what_is_wrong() -> None:
    w = World().add(
        shaped("n0", CPU_16C_64G),
        shaped("n1", CPU_16C_64G),
        model("chat", min=2),
        model("idle", min=0),
        model("off"),
        model("broken"),
        model("huge", mem=4096.0),
        placed("chat-1", "chat", "n0"),
        placed("chat-2", "chat", "n1"),
        ready("chat-1"),
        on_model("off", M.ModelStopped(saved_min=1, saved_max=1)),
        on_model("broken", M.ModelParked(reason="engine exited with 1, 5 times", failures=5)),
        on_node("n1", N.NodeLost(node_id="n1", last_seen=World().when(), silent_s=31.0)),
    )
    blocked = [d.model for d in w.run() if isinstance(d, Blocked)]
    assert "huge" in blocked
    figures = fleet_figures(w.state, T0 + w.t, CFG, blocked)
    by_model = {f.model: f for f in figures.models}
    assert (by_model["chat"].ready, by_model["chat"].desired) == (1, 2)
    assert by_model["idle"].desired == 0, "on demand and never asked for: nothing should run"
    assert by_model["off"].desired == 0, "stopped by an administrator"
    assert by_model["broken"].parked and by_model["broken"].desired == 1 and by_model["broken"].ready == 0
    assert by_model["huge"].unplaceable and not by_model["chat"].unplaceable
    assert figures.nodes == {"ready": 1, "cordoned": 0, "lost": 1}


def test_a_model_that_is_gone_leaves_no_series_and_a_standby_publishes_only_that_it_does_not_lead() -> None:
    w = World().add(shaped("n0", CPU_16C_64G), model("chat"), model("old"))
    registry, leads, blocked = CollectorRegistry(), [True], ["chat"]
    registry.register(FleetCollector("sched-a", lambda: w.state, lambda: leads[0], lambda: blocked, CFG, lambda: T0))
    assert registry.get_sample_value("llmgw_model_replicas_desired", {"model": "old"}) == 1
    assert registry.get_sample_value("llmgw_model_unplaceable", {"model": "chat"}) == 1
    assert registry.get_sample_value("llmgw_control_plane_leader", {"instance": "sched-a"}) == 1
    w.add(on_model("old", M.ModelRemoved()))  # computed when scraped: the next scrape sees it
    assert registry.get_sample_value("llmgw_model_replicas_desired", {"model": "old"}) is None
    assert registry.get_sample_value("llmgw_model_replicas_ready", {"model": "chat"}) == 0
    leads[0] = False
    assert registry.get_sample_value("llmgw_model_replicas_ready", {"model": "chat"}) is None
    assert registry.get_sample_value("llmgw_nodes", {"state": "ready"}) is None
    assert registry.get_sample_value("llmgw_control_plane_leader", {"instance": "sched-a"}) == 0


def published_series() -> set[str]:
    """Every series name the code publishes, from each process's metrics in one registry."""
    registry = CollectorRegistry()
    StoreMetrics(registry)
    ProjectionMetrics(registry)
    CertificateExpiry(registry)
    RouterMetrics(registry)
    BackupMetrics(registry)
    UsageMetrics(registry, lambda: (0, None, False, 0))
    registry.register(DroppedLinesCollector(lambda: None))
    registry.register(PoolSaturation(lambda: [("chat", 0.5)]))
    registry.register(QueueDepth(lambda: {"chat": 0}))
    registry.register(FleetCollector("sched-a", ClusterState, lambda: True, list, CFG))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + end for f in registry.collect() for end in suffixes.get(f.type, ("",))}


def test_every_series_an_alert_reads_is_one_the_system_publishes() -> None:
    published = published_series()
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {"ModelHasNothingServing", "ModelParked", "ModelFailingToStart", "ModelCannotBePlaced"} <= names
    assert {"ControlPlaneLeadership", "NodeLost", "ProjectionLagging", "PoolSaturated"} <= names
    assert {"CertificateExpiresSoon", "CertificateExpiresVerySoon"} <= names
    assert {"ModelPreempted"} <= names
    assert {"BackupTooOld"} <= names
    for rule in rules:
        used = set(re.findall(r"\bllmgw_[a-z_]+", rule["expr"]))
        assert used, f"{rule['alert']} reads no llmgw series"
        missing = used - published
        assert not missing, f"alert {rule['alert']} reads {sorted(missing)}, which nothing publishes"
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


# -- scraped from a running control plane ----------------------------------------------------


async def scrape(fleet: Fleet) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{fleet.admin_port}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_the_leading_scheduler_publishes_what_runs_what_should_and_what_cannot(
    fleet: Fleet, tmp_path: Path
) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    fleet.agent("n1")
    await fleet.add_model("tiny", tiny)
    await fleet.add_model("huge", tiny, memory_gb=100_000.0)  # no node has that much memory
    await fleet.wait_ready("tiny", 1)

    def value(series: dict, name: str, **labels: str) -> float | None:
        return series.get((name, tuple(sorted(labels.items()))))

    async def published() -> dict | None:
        series = await scrape(fleet)
        wanted = (
            value(series, "llmgw_model_replicas_ready", model="tiny") == 1
            and value(series, "llmgw_model_unplaceable", model="huge") == 1
            and value(series, "llmgw_nodes", state="ready") == 1
        )
        return series if wanted else None

    series = await wait_until(published, deadline_s=30, what="the fleet's series on /metrics")
    assert value(series, "llmgw_model_replicas_desired", model="tiny") == 1
    assert value(series, "llmgw_model_unplaceable", model="tiny") == 0
    assert value(series, "llmgw_model_replicas_ready", model="huge") == 0
    assert value(series, "llmgw_model_replicas_desired", model="huge") == 1
    assert value(series, "llmgw_model_parked", model="tiny") == 0
    assert (value(series, "llmgw_node_memory_total_bytes", node="n1") or 0) > 0, "the node's own report"
    leaders = [v for (name, _), v in series.items() if name == "llmgw_control_plane_leader"]
    assert leaders == [1.0]


def test_pool_saturation_is_in_flight_over_the_slots_of_the_ready_replicas() -> None:
    ready = {"chat": ["c1", "c2"], "code": ["k1"], "cold": []}
    outstanding = {"c1": 4, "c2": 6, "k1": 1, "gone": 9}
    assert pool_loads(ready, outstanding, slots=4) == [("chat", 1.25), ("code", 0.25)]
    registry = CollectorRegistry()
    registry.register(PoolSaturation(lambda: pool_loads(ready, outstanding, slots=4)))
    assert registry.get_sample_value("llmgw_pool_saturation", {"model": "chat"}) == 1.25
    outstanding["c1"] = 0  # computed when scraped: the next scrape sees the change
    assert registry.get_sample_value("llmgw_pool_saturation", {"model": "chat"}) == 0.75


def test_pool_saturation_counts_the_requests_waiting_in_the_gateway_and_each_replicas_own_slots() -> None:
    ready = {"chat": ["c1", "c2"]}
    # The queue keeps in flight at the slots (2 + 6): the requests waiting in it say how far past them.
    loads = pool_loads(ready, {"c1": 2, "c2": 6}, slots={"c1": 2, "c2": 6}, waiting={"chat": 4})
    assert loads == [("chat", 1.5)]


def test_each_node_s_latest_heartbeat_becomes_series_and_a_missing_sensor_stays_absent() -> None:
    w = World().add(
        shaped("cpu", CPU_16C_64G), node("gpu", 64, 512, gpus=2, gpu_mem_gb=80), shaped("gone", CPU_16C_64G)
    )
    hb = w.beats["gpu"]
    hot = msgspec.structs.replace(hb.gpus[0], temperature_c=71.0, power_w=350.5, throttle=["hw_slowdown"])
    w.state.observe(
        msgspec.structs.replace(
            hb, gpus=[hot, hb.gpus[1]], sensors={"temp.coretemp.package_id_0": 55.0, "power.package-0_w": 120.0}
        ),
        w.t,
    )
    w.add(on_node("gone", N.NodeLost(node_id="gone", last_seen=w.when(), silent_s=31.0)))
    samples = {(name, labels): value for name, labels, value in node_samples(w.state)}
    assert samples[("llmgw_node_memory_total_bytes", ("cpu",))] == 64 * 1024**3
    assert samples[("llmgw_gpu_memory_total_bytes", ("gpu", "1"))] == 80 * 1024**3
    assert samples[("llmgw_gpu_temperature_celsius", ("gpu", "0"))] == 71.0
    assert samples[("llmgw_gpu_power_watts", ("gpu", "0"))] == 350.5
    assert samples[("llmgw_gpu_throttled", ("gpu", "0", "hw_slowdown"))] == 1.0
    assert samples[("llmgw_node_temperature_celsius", ("gpu", "coretemp.package_id_0"))] == 55.0
    assert samples[("llmgw_node_power_watts", ("gpu", "package-0"))] == 120.0
    assert ("llmgw_gpu_temperature_celsius", ("gpu", "1")) not in samples, "a GPU without the sensor has no series"
    assert not [k for k in samples if k[1][0] == "gone"], "a lost node's last heartbeat is not reported as now"
    assert {name for name, _ in samples} <= set(NODE_SERIES)

    registry = CollectorRegistry()
    leads = [False]
    registry.register(FleetCollector("sched-a", lambda: w.state, lambda: leads[0], list, CFG))
    assert registry.get_sample_value("llmgw_gpu_power_watts", {"node": "gpu", "gpu": "0"}) is None, "a standby"
    leads[0] = True
    assert registry.get_sample_value("llmgw_gpu_power_watts", {"node": "gpu", "gpu": "0"}) == 350.5
