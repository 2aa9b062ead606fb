"""Nodes: what agents report (telemetry) and what the scheduler records of it (durable events).

Agents publish heartbeats on ``llmgw.tel.node.<id>`` (a bounded stream). The scheduler turns what
changes — a node registered, its capacity changed, it went silent, it came back — into durable
events on ``llmgw.evt.node.<id>``; cordon, uncordon and drain are commands with events too.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from llmgw.events.schema.registry import EventType

AGGREGATE = "node"
SERVICE = "fleet"


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    name: str
    memory_total_mb: int
    memory_used_mb: int | None = None
    uuid: str | None = None
    # Sensors (FLEET-3): absent when the machine lacks them, never zero.
    temperature_c: float | None = None
    memory_temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    throttle: list[str] = []


class ReplicaReport(msgspec.Struct, frozen=True, kw_only=True):
    """One engine an agent runs, as it sees it now."""

    replica_id: str
    model: str
    pid: int
    port: int
    state: str  # starting | ready | failed | stopping
    spec_hash: str = ""
    rss_bytes: int | None = None
    cpu_cores_used: float | None = None
    # The engine's own signals (SCHED-9), scraped from its ``/metrics`` (and ``/slots``) on the
    # heartbeat's cadence: None where the engine does not say (no metrics yet, an older agent).
    requests_running: int | None = None
    requests_waiting: int | None = None
    slots: int | None = None  # concurrent sequences the engine serves (llama.cpp ``--parallel``)
    kv_cache_usage: float | None = None  # 0..1
    prompt_tokens_per_s: float | None = None  # since the previous scrape
    generation_tokens_per_s: float | None = None
    metrics_at: datetime | None = None  # when the signals above were read
    metrics_error: str = ""  # why the last scrape failed ("" when it answered)
    # The engine's metrics stopped answering several scrapes in a row while its process lives: the
    # routers stop sending it requests before the node itself is called lost.
    unreachable: bool = False


class NodeHeartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """Telemetry, every 5 s (FLEET-1, FLEET-2). Missing data is None, and constrains nothing."""

    node_id: str
    at: datetime
    agent_version: str
    agent_started_at: datetime
    address: str
    labels: dict[str, str] = {}
    cpus: int | None = None
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    memory_used_bytes: int | None = None
    disk_free_bytes: int | None = None
    gpus: list[GpuInfo] = []
    engines: list[str] = []
    replicas: list[ReplicaReport] = []
    sensors: dict[str, float] = {}
    # MODEL/VERSION/FILE of each whole file in the weights cache, and the absolute path of each
    # weight file under the node's model directories (FLEET-8)
    weights: list[str] = []


class NodeCapacity(msgspec.Struct, frozen=True, kw_only=True):
    """The part of a heartbeat that placement depends on; a change is a durable event."""

    address: str
    labels: dict[str, str] = {}
    cpus: int | None = None
    memory_total_bytes: int | None = None
    gpus: list[GpuInfo] = []
    engines: list[str] = []
    agent_version: str = ""


class NodeRegistered(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    capacity: NodeCapacity


class NodeCapacityChanged(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    capacity: NodeCapacity


class NodeLost(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    last_seen: datetime
    silent_s: float


class NodeReturned(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str


class NodeCordoned(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    reason: str = ""


class NodeUncordoned(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str


class NodeDrainRequested(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    grace_s: float = 300.0


EVENTS = (
    EventType("node.registered", 1, NodeRegistered, "A node's agent reported in for the first time."),
    EventType(
        "node.capacity_changed", 1, NodeCapacityChanged, "A node's CPUs, memory, GPUs, labels or engines changed."
    ),
    EventType("node.lost", 1, NodeLost, "A node was silent past the limit; its replicas are replaced elsewhere."),
    EventType("node.returned", 1, NodeReturned, "A lost node reported in again."),
    EventType("node.cordoned", 1, NodeCordoned, "No new replicas are placed on the node."),
    EventType("node.uncordoned", 1, NodeUncordoned, "The node takes new replicas again."),
    EventType(
        "node.drain_requested", 1, NodeDrainRequested, "The node's replicas are to move elsewhere (and it is cordoned)."
    ),
)


class CordonNode(msgspec.Struct, frozen=True, kw_only=True, tag="cordon", forbid_unknown_fields=True):
    node_id: str
    reason: str = ""


class UncordonNode(msgspec.Struct, frozen=True, kw_only=True, tag="uncordon", forbid_unknown_fields=True):
    node_id: str


class DrainNode(msgspec.Struct, frozen=True, kw_only=True, tag="drain", forbid_unknown_fields=True):
    node_id: str
    grace_s: float = 300.0


FleetCommand = CordonNode | UncordonNode | DrainNode
