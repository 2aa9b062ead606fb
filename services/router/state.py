"""What a router knows, folded live from the log: keys, scopes, limits, prices, budgets, models,
ready replicas. Every router folds the same events, so a revoked key is refused by all of them
as soon as each has read one more event (SPEC TEN-2: within seconds).
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from llmgw.events.folds import keys as K
from llmgw.events.folds import models as MF
from llmgw.events.folds import replicas as F
from llmgw.events.folds.tenancy import TREE_EVENTS, Scope, TenancyTree
from llmgw.events.schema import access as A
from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import aggregate_of


class ModelInfo(msgspec.Struct, MF.ModelStatusView, kw_only=True):
    """The catalog's view of a model (the shared fold) plus what only the router tracks."""

    name: str
    status: MF.ModelStatus
    unplaceable: str | None = None

    @property
    def on_demand(self) -> bool:
        return self.status.min == 0


class ReplicaInfo(msgspec.Struct, kw_only=True, array_like=True):  # an array in snapshots, as K.Key is
    replica_id: str
    model: str
    node_id: str
    state: str = "placed"
    url: str | None = None
    slots: int | None = None  # requests its engine runs at once; None: RouterConfig.saturation


# vLLM's own default batch (max_num_seqs) when a profile does not say `parallel`: the gateway's queue
# must not hold requests back from an engine that batches hundreds.
VLLM_SLOTS = 256


def slots_of(profile: M.Profile) -> int | None:
    """The requests a replica's engine serves at once, when its profile says (or its engine implies)."""
    if profile.parallel:
        return profile.parallel
    return VLLM_SLOTS if profile.engine == "vllm" else None


# A key, a scope's budget and a model's price as the shared fold keeps them: the router checks
# the fold's own records, it does not copy them into structs of its own.
KeyInfo = K.Key
Budget = K.Budget
Price = K.Price


SNAPSHOT_NAME = "router"
# Bump when RouterSnapshot or a struct in it changes: older snapshots are then ignored. 2: keys and
# replicas encoded as arrays (K.Key, ReplicaInfo), not maps. 3: a replica's slots. 4: a key's ``external``.
SNAPSHOT_VERSION = 4


class RouterSnapshot(msgspec.Struct, kw_only=True):
    """What a router's fold holds, as saved in a snapshot; the indexes (keys by prefix, aliases) are rebuilt."""

    position: int
    keys: dict[str, K.Key]  # the shared fold's, by id (revoked ones included)
    limits: dict[str, K.Limit]
    prices: dict[str, Price]
    budgets: dict[str, Budget]
    key_limits: dict[str, tuple[int | None, int | None]]  # RouterState.limits
    scopes: dict[str, Scope]
    placed: dict[str, tuple[str, str | None]]
    tree_seq: int
    models: dict[str, ModelInfo]
    replicas: dict[str, ReplicaInfo]
    ready: dict[str, list[str]]  # model -> ready replica ids, in the order they became ready


class RouterState:
    def __init__(self) -> None:
        # Keys, limits, prices and budgets are the shared fold's (events/folds/keys.py); the router
        # indexes the live keys by prefix and the limits as admission reads them.
        self.access = K.AccessBook()
        self.keys: dict[str, K.Key] = {}  # live keys by prefix: the shared fold's records
        self.tree = TenancyTree()  # the shared fold (events/folds/tenancy.py): a key's project, team and org
        self.limits: dict[str, tuple[int | None, int | None]] = {}  # "project:<id>" -> (rpm, tpm)
        self.prices: dict[str, Price] = self.access.prices
        self.budgets: dict[str, Budget] = self.access.budgets
        self.models: dict[str, ModelInfo] = {}
        self.aliases: dict[str, str] = {}
        self.replicas: dict[str, ReplicaInfo] = {}
        self.ready_by_model: dict[str, dict[str, ReplicaInfo]] = {}
        self.position = 0
        self._ready_signal: dict[str, asyncio.Event] = {}

    # -- queries on the request path ---------------------------------------------------------

    def resolve(self, name: str) -> ModelInfo | None:
        m = self.models.get(name)
        if m is None and name in self.aliases:
            m = self.models.get(self.aliases[name])
        return m

    def ready(self, model: str) -> list[ReplicaInfo]:
        return list(self.ready_by_model.get(model, {}).values())

    def starting(self, model: str) -> int:
        return sum(1 for r in self.replicas.values() if r.model == model and r.state in ("placed", "starting"))

    def scopes_of(self, key: K.Key) -> list[str]:
        """The key's scopes, most specific first: key, project, team, org."""
        return [f"key:{key.id}", f"project:{key.project_id}", *self.tree.scopes_above(key.project_id)]

    def scope_label(self, scope: str, key: K.Key | None = None) -> str:
        """A scope as a person reads it: ``project:acme/ml/chat``, ``key:llmgw-abcd1234`` (not ids)."""
        if key is not None and scope == f"key:{key.id}":
            return f"key:{A.KEY_PREFIX}-{key.prefix}"
        return self.tree.label(scope)

    def ready_event(self, model: str) -> asyncio.Event:
        ev = self._ready_signal.get(model)
        if ev is None:
            ev = self._ready_signal[model] = asyncio.Event()
        return ev

    # -- snapshots ---------------------------------------------------------------------------

    def snapshot(self) -> RouterSnapshot:
        """The fold's state as a snapshot holds it (the structs are shared, not copied: encode it at once)."""
        return RouterSnapshot(
            position=self.position,
            keys=self.access.keys,
            limits=self.access.limits,
            prices=self.access.prices,
            budgets=self.access.budgets,
            key_limits=self.limits,
            scopes=self.tree.scopes,
            placed=self.tree.placed,
            tree_seq=self.tree.last_seq,
            models=self.models,
            replicas=self.replicas,
            ready={m: list(rs) for m, rs in self.ready_by_model.items()},
        )

    def encode(self) -> bytes:
        return _snapshot_encoder.encode(self.snapshot())

    @classmethod
    def decode(cls, data: bytes) -> RouterState:
        """A state from :meth:`encode`'s bytes, its indexes rebuilt (raises on bytes that do not decode)."""
        snap = _snapshot_decoder.decode(data)
        state = cls()
        state.position = snap.position
        state.access.keys, state.access.limits = snap.keys, snap.limits
        state.access.prices = state.prices = snap.prices
        state.access.budgets = state.budgets = snap.budgets
        state.limits = snap.key_limits
        state.tree.scopes, state.tree.placed, state.tree.last_seq = snap.scopes, snap.placed, snap.tree_seq
        state.models, state.replicas = snap.models, snap.replicas
        state.keys = {k.prefix: k for k in snap.keys.values() if not k.revoked}
        for model, ids in snap.ready.items():
            ready = {i: snap.replicas[i] for i in ids if i in snap.replicas}
            if ready:
                state.ready_by_model[model] = ready
                state.ready_event(model).set()
        state._reindex_aliases()
        return state

    # -- the fold ----------------------------------------------------------------------------

    def apply(self, e: RecordedEvent) -> None:
        self.position = max(self.position, e.seq)
        p = e.payload
        match p:
            case _ if isinstance(p, K.ACCESS_EVENTS):  # the shared fold (events/folds/keys.py)
                self._apply_access(p)
            case _ if isinstance(p, TREE_EVENTS):  # the shared tenancy fold (events/folds/tenancy.py)
                self.tree.apply(e)
            case _ if isinstance(p, M.MODEL_EVENTS):  # the shared lifecycle fold (MF.fold_model)
                name = aggregate_of(e.subject)[1]
                old = self.models.get(name)
                status = MF.fold_model(old.status if old else None, p)
                if status is None:
                    self.models.pop(name, None)
                else:
                    keep = old.unplaceable if old is not None and not isinstance(p, M.ModelAdded) else None
                    self.models[name] = ModelInfo(name=name, status=status, unplaceable=keep)
                if isinstance(p, M.ModelAdded | M.ModelChanged | M.ModelRemoved):
                    self._reindex_aliases()
            case SCH.PlacementBlocked():
                m = self.models.get(p.model)
                if m:
                    m.unplaceable = p.reason
            case R.ReplicaPlaced():
                self.replicas[p.replica_id] = ReplicaInfo(
                    replica_id=p.replica_id, model=p.model, node_id=p.node_id, slots=slots_of(p.profile)
                )
                m = self.models.get(p.model)
                if m:
                    m.unplaceable = None
            case (
                R.ReplicaStarting()
                | R.ReplicaReady()
                | R.ReplicaFailed()
                | R.ReplicaStopRequested()
                | R.ReplicaStopped()
            ):
                r = self.replicas.get(p.replica_id)
                # The move is the shared fold's (events/folds/replicas.py); a router keeps only what routes.
                state = F.transition(r.state, p) if r else None
                if r is not None and state is not None:
                    self._move(r, state, p)

    def _apply_access(self, p: msgspec.Struct) -> None:
        key_id = K.key_id_of(p)
        before = self.access.keys.get(key_id) if key_id is not None else None
        self.access.apply(p)
        if key_id is not None and (key := self.access.keys.get(key_id)) is not None:
            if before is not None and (held := self.keys.get(before.prefix)) is not None and held.id == key_id:
                del self.keys[before.prefix]
            if not key.revoked:
                self.keys[key.prefix] = key
        scope = f"key:{key_id}" if key_id is not None else getattr(p, "scope", None)
        if isinstance(p, A.KeyCreated | A.LimitSet) and scope is not None:
            limit = self.access.limit_of(scope)
            if limit is None:
                self.limits.pop(scope, None)
            else:
                self.limits[scope] = (limit.rpm, limit.tpm)

    def _move(self, r: ReplicaInfo, state: str, p: msgspec.Struct) -> None:
        r.state = state
        if isinstance(p, R.ReplicaReady):
            r.url = p.url
            self.ready_by_model.setdefault(r.model, {})[r.replica_id] = r
            self.ready_event(r.model).set()
        elif state != "starting":
            self.ready_by_model.get(r.model, {}).pop(r.replica_id, None)
            if state in ("failed", "stopped"):
                del self.replicas[r.replica_id]  # a router keeps only what may serve or soon will
            if not self.ready_by_model.get(r.model):
                self.ready_event(r.model).clear()

    def _reindex_aliases(self) -> None:
        self.aliases = {a: m.name for m in self.models.values() for a in m.spec.aliases}


_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(RouterSnapshot)


def now_epoch() -> float:
    return time.time()
