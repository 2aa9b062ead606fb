"""The cluster as the scheduler sees it: folded from node, model and replica events plus heartbeats.

The fold is deterministic (same events, same state); ``observe`` adds what telemetry says now.
The reconcile pass reads this object and never changes it; only the shell folds into it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

import msgspec

from llmgw.events.folds import models as MF
from llmgw.events.folds import nodes as NF
from llmgw.events.folds import quotas as QF
from llmgw.events.folds import replicas as F
from llmgw.events.folds import tenancy as TF
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import replicas as R
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import aggregate_of
from llmgw.services.scheduler.load import LoadSample, ModelLoad, fold_load

GiB = 1024**3
T = TypeVar("T")
LOAD_STALE_S = 30.0  # a node's share of a model's load counts this long after its last heartbeat


def capacity_of(hb: N.NodeHeartbeat) -> N.NodeCapacity:
    """The placement-relevant part of a heartbeat: sensors and usage stripped, so they never churn it."""
    gpus = [N.GpuInfo(index=g.index, name=g.name, memory_total_mb=g.memory_total_mb, uuid=g.uuid) for g in hb.gpus]
    return N.NodeCapacity(
        address=hb.address,
        labels=hb.labels,
        cpus=hb.cpus,
        memory_total_bytes=hb.memory_total_bytes,
        gpus=gpus,
        engines=sorted(hb.engines),
        agent_version=hb.agent_version,
    )


class NodeState(msgspec.Struct, kw_only=True):
    """A node as the shared fold (``events/folds/nodes.py``) keeps it, plus the heartbeats this process saw."""

    id: str
    fact: NF.Node
    last_seen: float | None = None  # monotonic seconds of the last heartbeat this process saw
    heartbeat: N.NodeHeartbeat | None = None

    @property
    def capacity(self) -> N.NodeCapacity | None:
        return self.fact.capacity

    @property
    def registered(self) -> bool:
        return self.fact.registered

    @property
    def lost(self) -> bool:
        return self.fact.lost

    @property
    def cordoned(self) -> bool:
        return self.fact.cordoned

    @property
    def cordon_reason(self) -> str:
        return self.fact.cordon_reason

    @property
    def draining(self) -> bool:
        return self.fact.draining

    @property
    def drain_grace_s(self) -> float:
        return self.fact.drain_grace_s

    @property
    def drain_requested_at(self) -> float | None:
        return self.fact.drain_requested_at


class ModelState(msgspec.Struct, MF.ModelStatusView, kw_only=True):
    """The catalog's view of a model (the shared fold, ``MF.fold_model``) plus the scheduler's own."""

    name: str
    status: MF.ModelStatus
    starts: F.StartFailures = F.StartFailures()  # the shared fold of its start failures (parking, backoff)

    @property
    def failures(self) -> int:
        """Consecutive start failures since the last ready replica of its definition, an edit or a retry."""
        return self.starts.count

    @property
    def last_error(self) -> str:
        return self.starts.last_error

    @property
    def last_failure_at(self) -> float | None:
        return self.starts.last_failure_at

    @property
    def spec_hash(self) -> str:
        return self.starts.spec_hash


# A replica as the shared fold (``events/folds/replicas.py``) keeps it: every reader moves it the same way.
ReplicaState = F.Replica


SNAPSHOT_NAME = "scheduler"
SNAPSHOT_VERSION = 3  # bump when ClusterSnapshot or a struct in it changes: older snapshots are then ignored
# 3: the external models (GW-12), by name with their providers' hosts


class ClusterSnapshot(msgspec.Struct, kw_only=True):
    """The durable fold of a :class:`ClusterState`, as a snapshot holds it: the nodes' facts (heartbeats
    and demand are this process's observations, not the log's), the models and the replicas."""

    position: int
    nodes: dict[str, NF.Node]
    models: dict[str, ModelState]
    replicas: dict[str, ReplicaState]
    # The tenancy tree and the capacity quotas (SCHED-8): the scopes alive, where every scope ever
    # made sat (kind, parent id), and each scope's quota.
    scopes: dict[str, TF.Scope] = {}
    placed_scopes: dict[str, tuple[str, str | None]] = {}
    quotas: dict[str, QF.Quota] = {}
    external: dict[str, list[str]] = {}


def external_note(state: ClusterState, model: str) -> str | None:
    """What `ctl explain` and headroom say of a model served outside the cluster (GW-12); None for others."""
    hosts = state.external.get(model)
    if hosts is None:
        return None
    return (
        f"model {model} is served outside the cluster (by {', '.join(hosts)}): the scheduler places nothing "
        "for it, so nothing here can run it or fit more of it"
    )


class ClusterState:
    """Nodes, models and replicas, folded. ``replicas`` changes only through :meth:`apply` and
    :meth:`forget_inactive`, which keep the per-node and per-model indexes in step with it."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.models: dict[str, ModelState] = {}
        # Models served outside the cluster (GW-12) -> their providers' hosts: never placed, so not in
        # ``models``; kept only so `ctl explain` and headroom can say why there is nothing to say.
        self.external: dict[str, list[str]] = {}
        self.replicas: dict[str, ReplicaState] = {}
        self.position = 0
        # Indexes of ``replicas`` (a replica's model and node never change): a pass asks "what is
        # on this node" and "what runs this model" for every node and model, and scanning every
        # replica for each made a pass quadratic.
        self._on_node: dict[str, dict[str, ReplicaState]] = {}
        self._of_model: dict[str, dict[str, ReplicaState]] = {}
        self.demand: dict[str, float] = {}  # model -> epoch of the last request a router saw (on demand)
        # The engines' load per model (SCHED-9), from the heartbeats: each node's share of it, summed
        # into a series per model whenever a node reports (an observation, like demand).
        self.load: dict[str, ModelLoad] = {}
        # model -> source (a node, or "router:<id>" for a gateway's queue) -> its share of the load
        self._load_parts: dict[str, dict[str, LoadSample]] = {}
        # Whose capacity a model's replicas use, and how much each scope is guaranteed and may hold (SCHED-8):
        # the shared folds of the tree and of the quotas.
        self.tree = TF.TenancyTree()
        self.quotas: dict[str, QF.Quota] = {}
        # What quotas derive from replicas, owners, the tree and the quotas (owner chains, holdings,
        # guarantee shares) is kept until what it was derived from changes: most passes run at rest,
        # and a preempting pass summed and sorted every replica again (services/scheduler/quota.py).
        # capacity_version moves on any such change, scopes_version on a scope or quota change,
        # owners_version when a model is added, removed or given another owner, and model_versions[m]
        # on a change to model m or one of its replicas.
        self.capacity_version = 0
        self.scopes_version = 0
        self.owners_version = 0
        self.model_versions: dict[str, int] = {}
        self._derived: dict[str, tuple[object, object]] = {}

    def derived(self, key: str, compute: Callable[[ClusterState], T], version: object = None) -> T:
        """``compute(self)``, kept under ``key`` while ``version`` (by default, the capacity version)
        stays the same. What it returns is shared by every caller until then: read it, never change it."""
        version = self.capacity_version if version is None else version
        kept = self._derived.get(key)
        if kept is not None and kept[0] == version:
            return kept[1]  # type: ignore[return-value]
        value = compute(self)
        self._derived[key] = (version, value)
        return value

    def changed(self, model: str | None = None) -> None:
        """What :meth:`apply` records when a model (or one of its replicas) changes, or, without a model,
        a scope or quota: what was derived from it is derived again when next asked."""
        self.capacity_version += 1
        if model is None:
            self.scopes_version += 1
        else:
            self.model_versions[model] = self.model_versions.get(model, 0) + 1

    # -- fold of durable events ---------------------------------------------------------------

    def apply(self, event: RecordedEvent) -> None:
        self.position = max(self.position, event.seq)
        p = event.payload
        at = event.envelope.at.timestamp()
        match p:
            case _ if isinstance(p, M.MODEL_EVENTS):  # the shared lifecycle fold (MF.fold_model)
                self.changed(aggregate_of(event.subject)[1])
                self._apply_model(event)
            case _ if isinstance(p, NF.NODE_EVENTS):  # the shared node fold (events/folds/nodes.py)
                n = self.node(p.node_id)
                n.fact = NF.fold_node(n.fact, p, at)
            case _ if isinstance(p, TF.TREE_EVENTS):
                self.changed()
                self.tree.apply(event)
            case _ if isinstance(p, Q.QUOTA_EVENTS):
                self.changed()
                sid = aggregate_of(event.subject)[1]
                quota = QF.fold_quota(self.quotas.get(sid), p)
                if quota is None:
                    self.quotas.pop(sid, None)
                else:
                    self.quotas[sid] = quota
            case (
                R.ReplicaPlaced()
                | R.ReplicaStarting()
                | R.ReplicaReady()
                | R.ReplicaFailed()
                | R.ReplicaStopRequested()
                | R.ReplicaStopped()
                | R.ReplicaRestartRequested()
            ):
                self._apply_replica(p, at)

    def _apply_replica(self, p: msgspec.Struct, at: float) -> None:
        """One replica event through the shared folds: the replica's, then its model's start failures."""
        before = self.replicas.get(p.replica_id)  # type: ignore[attr-defined]
        after = F.fold_replica(before, p, at)
        if after is None or after is before:
            return
        self.changed(after.model)
        self._index(after)
        old = self.replicas.get(after.replaces) if after.replaces else None
        if old is not None:  # a restart's replacement moved: so does the restart of the one it replaces
            self._index(F.fold_replaced(old, after))
        m = self.models.get(after.model)
        if m is not None:
            m.starts = F.fold_start_failures(m.starts, p, at, before)

    def _index(self, r: ReplicaState) -> None:
        old = self.replicas.get(r.id)
        if old is not None and (old.node_id, old.model) != (r.node_id, r.model):
            self._unindex(old)
        self.replicas[r.id] = r
        self._on_node.setdefault(r.node_id, {})[r.id] = r
        self._of_model.setdefault(r.model, {})[r.id] = r

    def _unindex(self, r: ReplicaState) -> None:
        for index, key in ((self._on_node, r.node_id), (self._of_model, r.model)):
            group = index.get(key)
            if group is not None:
                group.pop(r.id, None)
                if not group:
                    del index[key]

    def _apply_model(self, event: RecordedEvent) -> None:
        p = event.payload
        name = aggregate_of(event.subject)[1]
        old = self.models.get(name)
        status = MF.fold_model(old.status if old else None, p)
        self.external.pop(name, None)
        if status is not None and status.spec.external:
            # Served by providers outside the cluster (GW-12): nothing is ever placed for it, so the
            # scheduler does not hold it at all; replicas of an earlier local definition stop as removed.
            self.external[name] = [p.host for p in M.cheapest_first(status.spec.external)]
            status = None
        if (old.spec.owner if old else None, old is None) != (status.spec.owner if status else None, status is None):
            self.owners_version += 1  # a model came, went or changed hands: the quota chains change
        if status is None:
            self.models.pop(name, None)
            return
        at = event.envelope.at.timestamp()
        if old is None or isinstance(p, M.ModelAdded):
            starts = F.fold_start_failures(F.StartFailures(), M.ModelAdded(spec=status.spec), at)
            self.models[name] = ModelState(name=name, status=status, starts=starts)
            return
        old.status = status
        old.starts = F.fold_start_failures(old.starts, p, at)

    def node(self, node_id: str) -> NodeState:
        n = self.nodes.get(node_id)
        if n is None:
            n = self.nodes[node_id] = NodeState(id=node_id, fact=NF.Node(id=node_id))
        return n

    # -- snapshots ---------------------------------------------------------------------------

    def snapshot(self) -> ClusterSnapshot:
        """The durable fold as a snapshot holds it (the structs are shared, not copied: encode it at once)."""
        return ClusterSnapshot(
            position=self.position,
            nodes={i: n.fact for i, n in self.nodes.items()},
            models=self.models,
            replicas=self.replicas,
            scopes=self.tree.scopes,
            placed_scopes=self.tree.placed,
            quotas=self.quotas,
            external=self.external,
        )

    def encode(self) -> bytes:
        return _snapshot_encoder.encode(self.snapshot())

    @classmethod
    def decode(cls, data: bytes) -> ClusterState:
        """A state from :meth:`encode`'s bytes, its indexes rebuilt (raises on bytes that do not decode)."""
        snap = _snapshot_decoder.decode(data)
        state = cls()
        state.position = snap.position
        state.nodes = {i: NodeState(id=i, fact=fact) for i, fact in snap.nodes.items()}
        state.models = snap.models
        state.tree.scopes = dict(snap.scopes)
        state.tree.placed = {k: (v[0], v[1]) for k, v in snap.placed_scopes.items()}
        state.quotas = dict(snap.quotas)
        state.external = dict(snap.external)
        for r in snap.replicas.values():
            state._index(r)
        return state

    # -- telemetry ---------------------------------------------------------------------------

    def observe(self, hb: N.NodeHeartbeat, now: float) -> None:
        n = self.node(hb.node_id)
        n.heartbeat, n.last_seen = hb, now
        self._observe_load(hb, now)

    def _observe_load(self, hb: N.NodeHeartbeat, now: float) -> None:
        """Each model's load on this node — its ready replicas whose engines answered — summed with the
        other nodes' latest into the model's series. A replica whose engine says nothing of its load
        (an older agent, a first scrape) counts as ready with nothing waiting."""
        parts: dict[str, LoadSample] = {}
        for r in hb.replicas:
            if r.state != "ready" or r.unreachable:
                continue
            old = parts.get(r.model)
            slots = r.slots if old is None else (None if old.slots is None or r.slots is None else old.slots + r.slots)
            parts[r.model] = LoadSample(
                at=now,
                waiting=(old.waiting if old else 0) + (r.requests_waiting or 0),
                running=(old.running if old else 0) + (r.requests_running or 0),
                ready=(old.ready if old else 0) + 1,
                slots=slots,
            )
        self._fold_parts(hb.node_id, parts, now)

    def observe_queue(self, router: str, waiting: dict[str, int], now: float) -> None:
        """A router's queue (the gateway holds requests when every replica is saturated, so that
        engines never queue them): its waiting requests per model join the model's load."""
        self._fold_parts(
            f"router:{router}",
            {model: LoadSample(at=now, waiting=n, running=0, ready=0, slots=0) for model, n in waiting.items()},
            now,
        )

    def _fold_parts(self, source: str, parts: dict[str, LoadSample], now: float) -> None:
        """``source``'s (a node's, a router's) share of each model's load, summed with the other
        sources' latest into the model's series; a model it no longer reports loses its share."""
        touched = set(parts)
        for model, by_source in self._load_parts.items():
            if source in by_source and model not in parts:
                touched.add(model)
        for model in touched:
            by_source = self._load_parts.setdefault(model, {})
            if model in parts:
                by_source[source] = parts[model]
            else:
                by_source.pop(source, None)
            for gone in [i for i, part in by_source.items() if now - part.at > LOAD_STALE_S]:
                del by_source[gone]  # a source silent this long says nothing of the load now
            total = LoadSample(
                at=now,
                waiting=sum(s.waiting for s in by_source.values()),
                running=sum(s.running for s in by_source.values()),
                ready=sum(s.ready for s in by_source.values()),
                slots=None
                if any(s.slots is None for s in by_source.values())
                else sum(s.slots or 0 for s in by_source.values()),
            )
            self.load[model] = fold_load(self.load.get(model), total)

    def forget_inactive(self, keep_s: float, now_epoch: float) -> None:
        """Drop stopped and failed replicas older than ``keep_s``: state stays small on a long-lived leader."""
        for r in [
            r
            for r in self.replicas.values()
            if not r.active and r.state != "draining" and now_epoch - r.placed_at > keep_s
        ]:
            del self.replicas[r.id]
            self._unindex(r)
            self.changed(r.model)

    # -- views -------------------------------------------------------------------------------

    def replicas_of(self, model: str) -> list[ReplicaState]:
        return list(self._of_model.get(model, {}).values())

    def replica_models(self) -> list[str]:
        """Every model with replicas in the state, removed models included."""
        return list(self._of_model)

    def replicas_on(self, node_id: str) -> list[ReplicaState]:
        return list(self._on_node.get(node_id, {}).values())


_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(ClusterSnapshot)


def gib(n: float | None) -> int:
    return int((n or 0) * GiB)


def epoch(dt: datetime) -> float:
    return dt.timestamp()
