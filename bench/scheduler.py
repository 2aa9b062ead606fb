"""`llmgw bench scheduler`: how long the scheduler's pure code takes on a large simulated cluster.

No NATS, no agents: a ClusterState is fed the events a real cluster would write (nodes of mixed
shapes registering, models of mixed profiles added, replicas placed and ready up to the target
count, a heartbeat from every node), then timed with ``time.perf_counter`` over many repetitions:

- one full reconcile pass at steady state (every model at its min: the pass every 5 s costs this),
- one pass after a node is lost (its replicas failed and replaced elsewhere: a pass with work),
  again with the folded state frozen out of the cyclic garbage collector's reach (``gc.freeze``),
- the same two at 100, 1,000 and 5,000 nodes, replicas and models in the same ratio,
- building ``candidates()`` for one model, and one placement decision (``place`` over every node).

A pass is pure, so the same state is timed again and again without being changed. Nothing here
asserts; the targets (50 ms a pass at 1,000 nodes / 5,000 replicas, 1 ms a placement) are printed
beside the figures.
"""

from __future__ import annotations

import gc
import math
import platform
import random
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from llmgw.bench import BenchError
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.subjects import event_subject
from llmgw.services.scheduler.candidates import candidates
from llmgw.services.scheduler.placement import GiB, Need, check, need_of, place
from llmgw.services.scheduler.reconcile import reconcile
from llmgw.services.scheduler.state import ClusterState, capacity_of
from llmgw.services.scheduler.vocabulary import Clock, Config, Place, Preempt

PASS_TARGET_MS = 50.0  # one pass, 1,000 nodes / 5,000 replicas
PREEMPT_TARGET_MS = 20.0  # a pass that preempts (SCHED-7), same cluster
PLACE_TARGET_MS = 1.0  # one placement decision over every node
T0 = 1_700_000_000.0
NOW = 10_000.0  # monotonic seconds "now": every node reported at NOW
CFG = Config()


class NodeShape(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    share: float  # of the fleet
    cpus: int | None
    mem_gb: int | None
    gpus: int = 0
    gpu_mem_gb: int = 0
    engines: tuple[str, ...] = ("llamacpp",)


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    share: float  # of the models
    scale: float = 1.0  # how many replicas a model of this shape runs, relative to the others
    engine: str = "llamacpp"
    cores: int | None = None
    mem_gb: float | None = None
    gpus: int = 0
    gpu_mem_gb: float = 0.0
    selector: bool = False  # pinned to one zone


# A fleet of mostly CPU nodes with a GPU tier, after GPUStack's hardware catalogue; old agents
# that report no CPUs or memory are in it too, because missing data must constrain nothing.
NODE_SHAPES = (
    NodeShape(name="cpu_16c_64g", share=0.35, cpus=16, mem_gb=64),
    NodeShape(name="cpu_64c_256g", share=0.25, cpus=64, mem_gb=256),
    NodeShape(name="cpu_8c_32g", share=0.13, cpus=8, mem_gb=32),
    NodeShape(name="gpu_l4x1", share=0.10, cpus=16, mem_gb=64, gpus=1, gpu_mem_gb=24, engines=("llamacpp", "vllm")),
    NodeShape(name="gpu_a100x4", share=0.08, cpus=64, mem_gb=512, gpus=4, gpu_mem_gb=40, engines=("llamacpp", "vllm")),
    NodeShape(
        name="gpu_h100x8", share=0.05, cpus=192, mem_gb=2048, gpus=8, gpu_mem_gb=80, engines=("llamacpp", "vllm")
    ),
    NodeShape(name="old_agent", share=0.04, cpus=None, mem_gb=None),
)
# GPU models run fewer replicas than CPU ones (the GPU tier is smaller), so that the fleet holds
# every replica asked for.
MODEL_SHAPES = (
    ModelShape(name="cpu-small", share=0.50, scale=1.5, cores=2, mem_gb=4),
    ModelShape(name="cpu-medium", share=0.20, cores=4, mem_gb=12, selector=True),
    ModelShape(name="cpu-large", share=0.08, scale=0.5, cores=8, mem_gb=32),
    ModelShape(name="gpu-1x24", share=0.12, scale=0.4, engine="vllm", mem_gb=8, gpus=1, gpu_mem_gb=20),
    ModelShape(name="gpu-2x40", share=0.07, scale=0.2, engine="vllm", mem_gb=16, gpus=2, gpu_mem_gb=40),
    ModelShape(name="gpu-4x80", share=0.03, scale=0.1, engine="vllm", mem_gb=32, gpus=4, gpu_mem_gb=80),
)
ZONES = ("a", "b", "c")


class Sim(msgspec.Struct, kw_only=True):
    nodes: int
    models: int
    replicas: int  # placed and ready
    wanted: int  # replicas asked for (the sum of the models' min); more than fit is left unplaced
    events: int
    build_s: float


# -- the simulated cluster -----------------------------------------------------------------------


def _spread(total: int, shares: list[float]) -> list[int]:
    """``total`` split by ``shares``, every part at least 1 when total allows, summing to ``total``."""
    raw = [total * s / sum(shares) for s in shares]
    out = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def simulate(n_nodes: int, n_models: int, n_replicas: int, seed: int = 7) -> tuple[ClusterState, Sim]:
    """A ClusterState fed the events of a running cluster: every model at its min, every replica ready."""
    started = time.perf_counter()
    rnd = random.Random(seed)
    state = ClusterState()
    seq = 0
    at = datetime.fromtimestamp(T0, UTC)

    def emit(aggregate: str, agg_id: str, payload: msgspec.Struct) -> None:
        nonlocal seq
        seq += 1
        env = Envelope(id=f"e{seq}", type="bench", at=at, actor="system:bench")
        state.apply(RecordedEvent(envelope=env, payload=payload, subject=event_subject(aggregate, agg_id), seq=seq))

    # Nodes: registered, then a heartbeat from each (a few hold the weights of some models).
    free: dict[str, list[float]] = {}  # node -> [cores, memory GB] left, for the fill below
    free_gpus: dict[str, list[int]] = {}
    node_ids: list[str] = []
    counts = _spread(n_nodes, [s.share for s in NODE_SHAPES])
    shape_of: dict[str, NodeShape] = {}
    for shape, count in zip(NODE_SHAPES, counts, strict=True):
        for _ in range(count):
            node_id = f"node-{len(node_ids):05d}"
            node_ids.append(node_id)
            shape_of[node_id] = shape
            hb = N.NodeHeartbeat(
                node_id=node_id,
                at=at,
                agent_version="bench",
                agent_started_at=at,
                address=f"http://{node_id}:9000",
                labels={"zone": ZONES[len(node_ids) % len(ZONES)]},
                cpus=shape.cpus,
                memory_total_bytes=None if shape.mem_gb is None else shape.mem_gb * GiB,
                disk_free_bytes=500 * GiB,
                gpus=[
                    N.GpuInfo(index=i, name="gpu", memory_total_mb=shape.gpu_mem_gb * 1024) for i in range(shape.gpus)
                ],
                engines=list(shape.engines),
            )
            emit(N.AGGREGATE, node_id, N.NodeRegistered(node_id=node_id, capacity=capacity_of(hb)))
            state.observe(hb, NOW)
            free[node_id] = [float(shape.cpus or 10**6), float(shape.mem_gb or 10**6)]
            free_gpus[node_id] = list(range(shape.gpus))

    # Models: mixed profiles; their mins sum to the replicas wanted, a few models much larger.
    model_shapes: list[ModelShape] = []
    for shape, count in zip(MODEL_SHAPES, _spread(n_models, [s.share for s in MODEL_SHAPES]), strict=True):
        model_shapes += [shape] * count
    # A long tail: most models run a few replicas, some many (Pareto, capped at 20× the least).
    weights = [min(rnd.paretovariate(1.5), 20.0) * shape.scale for shape in model_shapes]
    mins = [max(1, m) for m in _spread(n_replicas, weights)]
    specs: list[M.ModelSpec] = []
    for i, (shape, lo) in enumerate(zip(model_shapes, mins, strict=True)):
        profile = M.Profile(
            engine=shape.engine,
            cpu_cores=shape.cores,
            min_memory_gb=shape.mem_gb,
            gpus=M.GpuRequest(count=shape.gpus, min_memory_gb=shape.gpu_mem_gb) if shape.gpus else None,
            node_selector={"zone": ZONES[i % len(ZONES)]} if shape.selector else {},
        )
        spec = M.ModelSpec(
            name=f"{shape.name}-{i:04d}", source=f"/models/{i}", scaling=M.Scaling(min=lo), profiles=[profile]
        )
        specs.append(spec)
        emit(M.AGGREGATE, spec.name, M.ModelAdded(spec=spec))

    # Replicas: a quick first fit over the nodes in a random order, placed then ready. The
    # scheduler itself is not used to fill the cluster: its own speed is what is measured.
    placed = 0
    ran: dict[str, int] = {}
    for spec in specs:
        need = need_of(spec.profiles[0])
        m = state.models[spec.name]
        order = node_ids[:]
        rnd.shuffle(order)
        ran[spec.name] = 0
        for node_id in order:
            if placed >= n_replicas or ran[spec.name] >= m.min:
                break
            if not _fits(shape_of[node_id], free[node_id], free_gpus[node_id], need, state, node_id):
                continue
            gpus = free_gpus[node_id][: need.gpus]
            del free_gpus[node_id][: need.gpus]
            free[node_id][0] -= need.cores
            free[node_id][1] -= need.memory_bytes / GiB
            rid = f"{spec.name}-{placed:06d}"
            emit(
                R.AGGREGATE,
                rid,
                R.ReplicaPlaced(
                    replica_id=rid,
                    model=spec.name,
                    node_id=node_id,
                    source=spec.source,
                    profile=spec.profiles[0],
                    spec_hash=m.spec_hash,
                    cores=need.cores,
                    memory_bytes=need.memory_bytes,
                    gpus=gpus,
                ),
            )
            emit(R.AGGREGATE, rid, R.ReplicaReady(replica_id=rid, node_id=node_id, pid=1, port=20000, url="http://x"))
            placed += 1
            ran[spec.name] += 1
    # A model whose min could not all be placed would make every pass a placing pass: it is
    # scaled to what runs, so that the steady state asks for exactly that.
    for spec in specs:
        if ran[spec.name] != state.models[spec.name].min:
            emit(M.AGGREGATE, spec.name, M.ModelScaled(min=ran[spec.name], max=ran[spec.name]))
    sim = Sim(
        nodes=n_nodes,
        models=n_models,
        replicas=placed,
        wanted=sum(mins),
        events=seq,
        build_s=time.perf_counter() - started,
    )
    return state, sim


def _fits(shape: NodeShape, free: list[float], gpus: list[int], need: Need, state: ClusterState, node_id: str) -> bool:
    if need.engine not in shape.engines or len(gpus) < need.gpus:
        return False
    if need.gpus and shape.gpu_mem_gb * 1024 < need.gpu_min_memory_mb:
        return False
    if need.node_selector:
        cap = state.nodes[node_id].capacity
        if cap is None or any(cap.labels.get(k) != v for k, v in need.node_selector.items()):
            return False
    return free[0] >= need.cores and free[1] >= need.memory_bytes / GiB


# -- timing --------------------------------------------------------------------------------------


class Timing(msgspec.Struct, kw_only=True):
    name: str
    what: str
    nodes: int
    replicas: int
    runs: int
    median_ms: float
    p90_ms: float
    target_ms: float | None = None

    @property
    def verdict(self) -> str:
        if self.target_ms is None:
            return ""
        return "ok" if self.median_ms <= self.target_ms else "MISSED"


def measure(fn: Callable[[], object], runs: int, min_runs: int = 5, budget_s: float = 20.0) -> list[float]:
    """Seconds per call, ``runs`` calls (fewer, but at least ``min_runs``, if ``budget_s`` runs out)."""
    fn()  # warm: first-call costs (imports, caches) are not the steady figure
    out: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(out) < runs and (len(out) < min_runs or time.perf_counter() < deadline):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _timing(name: str, what: str, sim: Sim, samples: list[float], target_ms: float | None = None) -> Timing:
    ms = sorted(s * 1000 for s in samples)
    p90 = ms[math.ceil(0.9 * len(ms)) - 1]  # nearest rank
    return Timing(
        name=name,
        what=what,
        nodes=sim.nodes,
        replicas=sim.replicas,
        runs=len(ms),
        median_ms=round(statistics.median(ms), 3),
        p90_ms=round(p90, 3),
        target_ms=target_ms,
    )


def clock() -> Clock:
    return Clock(monotonic=NOW + 1.0, epoch=T0 + 3600.0, started=0.0)


def lost_clock(state: ClusterState) -> tuple[Clock, str]:
    """A clock at which exactly one busy CPU node has gone silent; that node's id."""
    busy = max(
        (n for n in state.nodes.values() if n.capacity and not n.capacity.gpus and n.capacity.cpus),
        key=lambda n: (len(state.replicas_on(n.id)), n.id),
    )
    busy.last_seen = NOW - CFG.lost_after_s  # silent for lost_after_s + 1 at clock()
    return clock(), busy.id


def bench_scale(n_nodes: int, n_models: int, n_replicas: int, runs: int, echo: Callable[[str], None]) -> dict[str, Any]:
    echo(f"building {n_nodes:,} nodes, {n_models:,} models, {n_replicas:,} replicas")
    state, sim = simulate(n_nodes, n_models, n_replicas)
    echo(f"  {sim.events:,} events folded in {sim.build_s:.1f} s; {sim.replicas:,} replicas ready")
    timings: list[Timing] = []
    target = PASS_TARGET_MS if n_nodes == 1000 else None

    steady = reconcile(state, clock(), CFG)
    if steady:
        raise BenchError(f"the simulated cluster is not at rest: {len(steady)} decisions, e.g. {steady[0]}")
    echo("  timing reconcile passes at rest")
    timings.append(
        _timing(
            "pass.steady",
            "reconcile pass, every model at its min",
            sim,
            measure(lambda: reconcile(state, clock(), CFG), runs),
            target,
        )
    )

    lc, lost_node = lost_clock(state)
    work = reconcile(state, lc, CFG)
    placed = sum(1 for d in work if isinstance(d, Place))
    echo(f"  timing passes after {lost_node} is lost ({placed} replicas replaced)")
    timings.append(
        _timing(
            "pass.node_lost",
            f"reconcile pass, a node lost ({placed} replicas replaced)",
            sim,
            measure(lambda: reconcile(state, lc, CFG), runs),
            target,
        )
    )
    # The same pass with the cluster's objects out of the cyclic collector's reach (gc.freeze):
    # placement allocates per node, which at thousands of nodes sets off full collections that
    # walk the whole folded state. The gap between the two rows is what those cost.
    gc.collect()
    gc.freeze()
    try:
        frozen = measure(lambda: reconcile(state, lc, CFG), runs)
    finally:
        gc.unfreeze()
    timings.append(_timing("pass.node_lost.frozen", "  the same, the folded state gc.freeze()-ed", sim, frozen, target))
    state.nodes[lost_node].last_seen = NOW

    # One placement: `place` over every node for one model, the candidates built beforehand.
    names = sorted(state.models)
    picks = [names[i * len(names) // 25] for i in range(25)]  # a sample across the profiles
    cands = {name: list(candidates(state, name).values()) for name in picks}
    needs = {name: need_of(state.models[name].spec.profiles[0]) for name in picks}
    fitting = statistics.median(sum(1 for c in cands[n] if not check(c, needs[n])) for n in picks)
    rounds = max(1, runs // len(picks))
    samples: list[float] = []
    for name in picks:
        samples += measure(lambda name=name: place(cands[name], needs[name], f"{name}/0"), rounds, min_runs=rounds)
    timings.append(
        _timing(
            "place",
            f"one placement decision: place() over {n_nodes:,} nodes (median {fitting:.0f} fit)",
            sim,
            samples,
            PLACE_TARGET_MS if n_nodes == 1000 else None,
        )
    )
    samples = []
    for name in picks:
        samples += measure(lambda name=name: candidates(state, name), rounds, min_runs=rounds)
    timings.append(_timing("candidates", "candidates(state, model) for one model", sim, samples))

    victims = preempting(state)
    echo(f"  timing a pass that preempts ({victims} replicas give way to a critical model)")
    timings.append(
        _timing(
            "pass.preempting",
            f"reconcile pass that preempts ({victims} replicas give way)",
            sim,
            measure(lambda: reconcile(state, clock(), CFG), runs),
            PREEMPT_TARGET_MS if n_nodes == 1000 else None,
        )
    )
    return {"sim": msgspec.to_builtins(sim), "timings": timings}


def preempting(state: ClusterState, owner: str | None = None) -> int:
    """``state`` with a critical model (owned by ``owner``) that fits nowhere until other replicas give
    way: it wants a whole 8-GPU node, and every such node has a GPU in use (a 1-GPU filler replica
    where one was idle). Returns how many replicas the pass stops for it; raises when it would stop none."""
    seq = state.position
    at = datetime.fromtimestamp(T0, UTC)

    def emit(aggregate: str, agg_id: str, payload: msgspec.Struct) -> None:
        nonlocal seq
        seq += 1
        env = Envelope(id=f"p{seq}", type="bench", at=at, actor="system:bench")
        state.apply(RecordedEvent(envelope=env, payload=payload, subject=event_subject(aggregate, agg_id), seq=seq))

    def gpu_model(name: str, count: int, cls: str | None, lo: int, owner: str | None = None) -> M.ModelSpec:
        profile = M.Profile(engine="vllm", min_memory_gb=8, gpus=M.GpuRequest(count=count, min_memory_gb=80))
        spec = M.ModelSpec(
            name=name,
            source=f"/models/{name}",
            scaling=M.Scaling(min=lo),
            capacity_class=cls,
            owner=owner,
            profiles=[profile],
        )
        emit(M.AGGREGATE, name, M.ModelAdded(spec=spec))
        return spec

    big = [n for n in state.nodes.values() if n.capacity and len(n.capacity.gpus) == 8]
    idle = [n for n in big if not any(r.gpus for r in state.replicas_on(n.id) if r.active)]
    if idle:
        filler = gpu_model("filler", 1, None, len(idle))
        m = state.models[filler.name]
        for i, n in enumerate(sorted(idle, key=lambda n: n.id)):
            rid = f"filler-{i:04d}"
            placed = R.ReplicaPlaced(
                replica_id=rid,
                model=filler.name,
                node_id=n.id,
                source=filler.source,
                profile=filler.profiles[0],
                spec_hash=m.spec_hash,
                memory_bytes=8 * GiB,
                gpus=[0],
            )
            emit(R.AGGREGATE, rid, placed)
            emit(R.AGGREGATE, rid, R.ReplicaReady(replica_id=rid, node_id=n.id, pid=1, port=20000, url="http://x"))
    gpu_model("zz-critical", 8, "critical", 1, owner)
    decisions = reconcile(state, clock(), CFG)
    stopped = sum(len(d.replicas) for d in decisions if isinstance(d, Preempt))
    if not stopped:
        raise BenchError("the preempting pass stopped nothing: the simulated cluster has no victim set for the model")
    return stopped


def table(rows: list[Timing]) -> str:
    width = max(len(t.what) for t in rows)
    head = (
        f"{'figure':<{width}} {'nodes':>6} {'replicas':>8} {'runs':>5} {'median ms':>10} {'p90 ms':>9} {'target':>11}"
    )
    lines = [head, "-" * len(head)]
    for t in rows:
        target = f"≤ {t.target_ms:g} {t.verdict}" if t.target_ms is not None else ""
        lines.append(
            f"{t.what:<{width}} {t.nodes:>6,} {t.replicas:>8,} {t.runs:>5} {t.median_ms:>10.3f} {t.p90_ms:>9.3f}"
            f" {target:>11}"
        )
    return "\n".join(lines)


class SchedulerOptions(msgspec.Struct, frozen=True, kw_only=True):
    nodes: int = 1000
    models: int = 500
    replicas: int = 5000
    runs: int = 50
    scales: tuple[int, ...] = (100, 1000, 5000)  # node counts for the growth figures

    def sizes(self) -> list[int]:
        return sorted(set(self.scales) | {self.nodes})


def run_scheduler(opts: SchedulerOptions, echo: Callable[[str], None]) -> dict[int, dict[str, Any]]:
    """Every figure at every size; per size, the simulated cluster (``sim``) and its ``timings``."""
    results: dict[int, dict[str, Any]] = {}
    for n in opts.sizes():
        m = max(1, round(opts.models * n / opts.nodes))
        r = max(1, round(opts.replicas * n / opts.nodes))
        results[n] = bench_scale(n, m, r, opts.runs, echo)
    return results


def machine_info() -> dict[str, str]:
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": platform.processor()}


def scheduler_json(opts: SchedulerOptions, results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    sizes = opts.sizes()
    return {
        "machine": machine_info(),
        "options": {
            "nodes": opts.nodes,
            "models": opts.models,
            "replicas": opts.replicas,
            "runs": opts.runs,
            "scales": sizes,
        },
        "clusters": {n: results[n]["sim"] for n in sizes},
        "figures": {n: [msgspec.to_builtins(t) | {"verdict": t.verdict} for t in results[n]["timings"]] for n in sizes},
    }


def scheduler_text(opts: SchedulerOptions, results: dict[int, dict[str, Any]]) -> str:
    sizes = opts.sizes()
    machine = machine_info()
    main = results[opts.nodes]["timings"]
    lines = [
        f"machine: {machine['platform']}, Python {machine['python']}",
        f"cluster: {opts.nodes:,} nodes, {opts.models:,} models, "
        f"{results[opts.nodes]['sim']['replicas']:,} replicas ready\n",
        table(main),
    ]
    if len(sizes) > 1:
        lines.append("\ngrowth (models and replicas in the same ratio to nodes):\n")
        order = [t.name for t in main]
        rows = [t for n in sizes for t in results[n]["timings"]]
        lines.append(table(sorted(rows, key=lambda t: (order.index(t.name), t.nodes))))
    return "\n".join(lines)
