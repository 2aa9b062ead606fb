"""Builders for scheduler tests: a ClusterState folded from the same events the real shell folds.

A :class:`World` holds a ClusterState, a clock and an event counter. Facts (``node(...)``,
``model(...)``, ``placed(...)``, ``ready(...)``, ``failed(...)``, …) are small functions of the
world that append events to it or observe heartbeats, so a test reads as the story of a cluster:

    w = World().add(node("a", cpus=8, mem_gb=32), model("m", min=2, cores=2, mem=4))
    decisions = w.run()

``World.commit`` turns decisions into events exactly as ``SchedulerService._events`` does, so a
test can run pass after pass. Time is one number, ``World.t`` (seconds): heartbeats are observed
at monotonic ``t``, events happen at epoch ``T0 + t``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime

import msgspec

from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.subjects import event_subject
from llmgw.services.scheduler.placement import Candidate, need_of
from llmgw.services.scheduler.reconcile import reconcile
from llmgw.services.scheduler.state import ClusterState, capacity_of
from llmgw.services.scheduler.vocabulary import (
    Autoscale,
    Blocked,
    Clock,
    Config,
    Decision,
    Fail,
    MarkLost,
    MarkReturned,
    Park,
    Place,
    Preempt,
    RegisterNode,
    Stop,
    Waiting,
    event_of,
)

GiB = 1024**3
T0 = 1_700_000_000.0  # epoch of t = 0
CFG = Config()


# -- node shapes, after GPUStack's hardware catalogue -------------------------------------------


class Shape(msgspec.Struct, frozen=True, kw_only=True):
    """What a kind of machine reports: ``None`` where an (old) agent reports nothing."""

    name: str
    cpus: int | None
    mem_gb: float | None
    gpus: int = 0
    gpu_mem_gb: int = 0
    engines: tuple[str, ...] = ("llamacpp",)


CPU_2C_8G = Shape(name="cpu_2c_8g", cpus=2, mem_gb=8)
CPU_8C_32G = Shape(name="cpu_8c_32g", cpus=8, mem_gb=32)
CPU_16C_64G = Shape(name="cpu_16c_64g", cpus=16, mem_gb=64)
CPU_64C_256G = Shape(name="cpu_64c_256g", cpus=64, mem_gb=256)
GPU_L4X1 = Shape(name="gpu_l4x1", cpus=16, mem_gb=64, gpus=1, gpu_mem_gb=24, engines=("llamacpp", "vllm"))
GPU_A100X4 = Shape(name="gpu_a100x4", cpus=64, mem_gb=512, gpus=4, gpu_mem_gb=40, engines=("llamacpp", "vllm"))
GPU_H100X8 = Shape(name="gpu_h100x8", cpus=192, mem_gb=2048, gpus=8, gpu_mem_gb=80, engines=("llamacpp", "vllm"))
OLD_AGENT = Shape(name="old_agent", cpus=None, mem_gb=None)  # reports neither CPUs nor memory
SHAPES = (CPU_2C_8G, CPU_8C_32G, CPU_16C_64G, CPU_64C_256G, GPU_L4X1, GPU_A100X4, GPU_H100X8, OLD_AGENT)


def gpu_list(count: int, mem_gb: int) -> list[N.GpuInfo]:
    return [N.GpuInfo(index=i, name=f"gpu{i}", memory_total_mb=mem_gb * 1024) for i in range(count)]


def candidate(shape: Shape, node_id: str, **fields: object) -> Candidate:
    """A placement candidate of ``shape`` with nothing reserved, unless ``fields`` say otherwise."""
    base = Candidate(
        node_id=node_id,
        engines=list(shape.engines),
        cpus=shape.cpus,
        memory_total_bytes=None if shape.mem_gb is None else int(shape.mem_gb * GiB),
        gpus={g.index: g.memory_total_mb for g in gpu_list(shape.gpus, shape.gpu_mem_gb)},
    )
    return msgspec.structs.replace(base, **fields)


# -- the world -----------------------------------------------------------------------------------

Fact = Callable[["World"], None]


class World:
    def __init__(self) -> None:
        self.state = ClusterState()
        self.t = 0.0
        self.seq = 0
        self.beats: dict[str, N.NodeHeartbeat] = {}
        self._replica_n = 0

    # -- writing ---------------------------------------------------------------------------

    def add(self, *facts: Fact | Iterable[Fact]) -> World:
        for f in facts:
            if callable(f):
                f(self)
            else:
                for g in f:
                    g(self)
        return self

    def emit(self, aggregate: str, agg_id: str, payload: msgspec.Struct, type_: str = "test") -> None:
        self.seq += 1
        env = Envelope(id=f"e{self.seq}", type=type_, at=self.when(), actor="user:test")
        self.state.apply(
            RecordedEvent(envelope=env, payload=payload, subject=event_subject(aggregate, agg_id), seq=self.seq)
        )

    def when(self) -> datetime:
        return datetime.fromtimestamp(T0 + self.t, UTC)

    def advance(self, seconds: float) -> World:
        self.t += seconds
        return self

    def beat(self, *node_ids: str) -> World:
        """The named nodes (every known node when none are named) report in now."""
        for node_id in node_ids or tuple(self.beats):
            self.state.observe(self.beats[node_id], self.t)
        return self

    def next_replica_id(self, model: str) -> str:
        self._replica_n += 1
        return f"{model}-r{self._replica_n}"

    # -- the scheduler ---------------------------------------------------------------------

    def clock(self) -> Clock:
        return Clock(monotonic=self.t, epoch=T0 + self.t, started=0.0)

    def run(self, cfg: Config = CFG) -> list[Decision]:
        return reconcile(self.state, self.clock(), cfg)

    def commit(self, decisions: list[Decision]) -> list[str]:
        """Fold decisions back as the events the shell would append; the new replica ids."""
        new: list[str] = []
        for d in decisions:
            rid = self.next_replica_id(d.model) if isinstance(d, Place) else ""
            found = event_of(d, self.state, replica_id=rid, term=0, last_seen=self.when())
            if found is None:
                continue
            self.emit(*found)
            if rid:
                new.append(rid)
        return new

    def step(self, cfg: Config = CFG) -> list[Decision]:
        """One pass, committed."""
        decisions = self.run(cfg)
        self.commit(decisions)
        return decisions

    # -- reading ---------------------------------------------------------------------------

    def active(self, model: str | None = None) -> list[str]:
        return sorted(r.id for r in self.state.replicas.values() if r.active and model in (None, r.model))

    def nodes_of(self, model: str) -> list[str]:
        return sorted(r.node_id for r in self.state.replicas.values() if r.active and r.model == model)


# -- facts ---------------------------------------------------------------------------------------


def heartbeat(
    node_id: str,
    cpus: int | None = 16,
    mem_gb: float | None = 64,
    *,
    gpus: int = 0,
    gpu_mem_gb: int = 80,
    engines: Iterable[str] = ("llamacpp",),
    labels: dict[str, str] | None = None,
    disk_gb: float | None = None,
    weights: Iterable[str] = (),
) -> N.NodeHeartbeat:
    at = datetime.fromtimestamp(T0, UTC)
    return N.NodeHeartbeat(
        node_id=node_id,
        at=at,
        agent_version="test",
        agent_started_at=at,
        address=f"http://{node_id}:9000",
        labels=dict(labels or {}),
        cpus=cpus,
        memory_total_bytes=None if mem_gb is None else int(mem_gb * GiB),
        disk_free_bytes=None if disk_gb is None else int(disk_gb * GiB),
        gpus=gpu_list(gpus, gpu_mem_gb),
        engines=list(engines),
        weights=list(weights),
    )


def node(
    node_id: str,
    cpus: int | None = 16,
    mem_gb: float | None = 64,
    *,
    register: bool = True,
    heard: bool = True,
    **more: object,
) -> Fact:
    """A node that registered (``node.registered``) and whose heartbeat is observed now.

    ``register=False``: only the heartbeat (an agent reporting for the first time);
    ``heard=False``: only the event (registered before this scheduler started, not heard since).
    """

    def fact(w: World) -> None:
        hb = heartbeat(node_id, cpus, mem_gb, **more)  # type: ignore[arg-type]
        w.beats[node_id] = hb
        if register:
            w.emit(N.AGGREGATE, node_id, N.NodeRegistered(node_id=node_id, capacity=capacity_of(hb)))
        if heard:
            w.state.observe(hb, w.t)

    return fact


def shaped(node_id: str, shape: Shape, **more: object) -> Fact:
    return node(
        node_id,
        shape.cpus,
        shape.mem_gb,
        gpus=shape.gpus,
        gpu_mem_gb=shape.gpu_mem_gb,
        engines=shape.engines,
        **more,
    )


def spec(
    name: str,
    min: int = 1,
    *,
    max: int | None = None,
    cores: int | None = None,
    mem: float | None = 4.0,
    gpus: int = 0,
    gpu_mem: float = 0.0,
    engine: str = "llamacpp",
    selector: dict[str, str] | None = None,
    disk: float | None = None,
    cls: str | None = None,
    owner: str | None = None,
) -> M.ModelSpec:
    profile = M.Profile(
        engine=engine,
        cpu_cores=cores,
        min_memory_gb=mem,
        gpus=M.GpuRequest(count=gpus, min_memory_gb=gpu_mem) if gpus else None,
        node_selector=dict(selector or {}),
        min_disk_gb=disk,
    )
    return M.ModelSpec(
        name=name,
        source=f"/models/{name}.gguf",
        scaling=M.Scaling(min=min, max=max),
        profiles=[profile],
        capacity_class=cls,
        owner=owner,
    )


def model(name: str, min: int = 1, cores: int | None = None, mem: float | None = 4.0, **more: object) -> Fact:
    """A model added to the catalog (``model.added``)."""

    def fact(w: World) -> None:
        w.emit(M.AGGREGATE, name, M.ModelAdded(spec=spec(name, min, cores=cores, mem=mem, **more)))  # type: ignore[arg-type]

    return fact


def on_model(name: str, payload: msgspec.Struct) -> Fact:
    """Any model event: ``on_model("m", M.ModelScaled(min=1, max=1))``."""
    return lambda w: w.emit(M.AGGREGATE, name, payload)


def on_node(node_id: str, payload: msgspec.Struct) -> Fact:
    return lambda w: w.emit(N.AGGREGATE, node_id, payload)


def on_replica(replica_id: str, payload: msgspec.Struct) -> Fact:
    return lambda w: w.emit(R.AGGREGATE, replica_id, payload)


def placed(replica_id: str, model: str, node_id: str, *, gpus: list[int] | None = None, stale: bool = False) -> Fact:
    """A replica the scheduler placed, reserving what the model's profile needs."""

    def fact(w: World) -> None:
        m = w.state.models[model]
        need = need_of(m.spec.profiles[0])
        payload = R.ReplicaPlaced(
            replica_id=replica_id,
            model=model,
            node_id=node_id,
            source=m.spec.source,
            profile=m.spec.profiles[0],
            spec_hash="stale" if stale else m.spec_hash,
            cores=need.cores,
            memory_bytes=need.memory_bytes,
            gpus=list(gpus if gpus is not None else range(need.gpus)),
        )
        w.emit(R.AGGREGATE, replica_id, payload)

    return fact


def ready(*replica_ids: str) -> Fact:
    def fact(w: World) -> None:
        for rid in replica_ids:
            r = w.state.replicas[rid]
            payload = R.ReplicaReady(replica_id=rid, node_id=r.node_id, pid=1, port=20000, url="http://x")
            w.emit(R.AGGREGATE, rid, payload)

    return fact


def failed(replica_id: str, reason: str = "engine exited with 1", *, node_lost: bool = False) -> Fact:
    def fact(w: World) -> None:
        r = w.state.replicas[replica_id]
        payload = R.ReplicaFailed(replica_id=replica_id, node_id=r.node_id, reason=reason, node_lost=node_lost)
        w.emit(R.AGGREGATE, replica_id, payload)

    return fact


def stopped(replica_id: str) -> Fact:
    def fact(w: World) -> None:
        r = w.state.replicas[replica_id]
        w.emit(R.AGGREGATE, replica_id, R.ReplicaStopped(replica_id=replica_id, node_id=r.node_id))

    return fact


def demand(model: str) -> Fact:
    """A router saw a request for ``model`` now (SCHED-12)."""

    def fact(w: World) -> None:
        w.state.demand[model] = T0 + w.t

    return fact


def beats(*node_ids: str) -> Fact:
    """The named nodes report in now (their last heartbeat, observed again)."""

    def fact(w: World) -> None:
        w.beat(*node_ids)

    return fact


def later(seconds: float) -> Fact:
    def fact(w: World) -> None:
        w.advance(seconds)

    return fact


# -- reading decisions ---------------------------------------------------------------------------


def said(d: Decision) -> str:
    """A decision as a short line, so that tables compare what a person would read."""
    match d:
        case Place():
            gpus = f" gpus {','.join(map(str, d.gpus))}" if d.gpus else ""
            return f"place {d.model} on {d.node_id}{gpus}"
        case Stop():
            return f"stop {d.replica_id}: {d.reason}"
        case Fail():
            return f"fail {d.replica_id}: {d.reason}"
        case MarkLost():
            return f"lost {d.node_id}"
        case MarkReturned():
            return f"returned {d.node_id}"
        case RegisterNode():
            return f"{'update' if d.changed else 'register'} {d.node_id}"
        case Park():
            return f"park {d.model}: {d.reason}"
        case Blocked():
            return f"blocked {d.model} ({d.wanted} wanted): {d.reason}"
        case Waiting():
            return f"waiting {d.model} until t={d.until - T0:g}" + (f": {d.why}" if d.why else "")
        case Preempt():
            return f"preempt {','.join(d.replicas)} of {d.model} ({d.capacity_class}) for {d.for_model}: {d.reason}"
        case Autoscale():
            return f"autoscale {d.model} {d.from_} -> {d.to}: {d.reason}"
    raise AssertionError(f"unknown decision {d!r}")
