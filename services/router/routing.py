"""Replica choice (SPEC GW-6): least load first, with prefix affinity until saturation.

Load is what the replica's engine reports waiting (and its KV cache in use) when it reports it,
plus the requests this router has in flight there. Requests that share a prompt prefix go to the
replica that served it last — its KV cache likely holds the prefix — unless that replica is
saturated (as many requests in flight as it has slots), when the preference is dropped. Pure: the
caller passes the load and a seed.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Mapping

import msgspec

from llmgw.events.schema.nodes import NodeHeartbeat
from llmgw.services.router.state import ReplicaInfo

PREFIX_CHARS = 512
# How a router orders replicas: "llmgw" (:func:`order`) in service; the others are baselines that benchmarks
# and tests set on a Router to compare against (not a setting: a gateway routes by load and prefix).
POLICIES = ("llmgw", "round_robin", "random")


def prefix_key(text: str) -> str | None:
    if len(text) < 32:
        return None  # too short to share a useful prefix
    return hashlib.blake2b(text[:PREFIX_CHARS].encode(), digest_size=8).hexdigest()


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """splitmix64's finalizer: ties between equally loaded replicas broken by seed and replica alike. (The
    low bits of Python's hash of a tuple can keep one order for every seed, so one replica came first.)"""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """What a replica's engine last said of its load (from the agent's heartbeat): requests waiting in
    the engine — other routers' too — the share of its KV cache in use, the slots it has, and whether
    its agent could reach it at all."""

    waiting: int = 0
    kv_usage: float | None = None
    slots: int | None = None
    unreachable: bool = False


ENGINE_STALE_S = 15.0  # three heartbeats: a node silent longer says nothing of its engines' load


def engine_loads(hb: NodeHeartbeat) -> dict[str, EngineLoad]:
    """Each ready engine's load as one heartbeat reports it; engines that report no signal are left out
    (routing falls back to this router's own count for them)."""
    out = {}
    for r in hb.replicas:
        if r.unreachable:
            out[r.replica_id] = EngineLoad(unreachable=True)
        elif r.requests_waiting is not None or r.kv_cache_usage is not None or r.slots is not None:
            out[r.replica_id] = EngineLoad(
                waiting=r.requests_waiting or 0, kv_usage=r.kv_cache_usage, slots=r.slots or None
            )
    return out


def slots_of(r: ReplicaInfo, engines: Mapping[str, EngineLoad] | None, saturation: int) -> int:
    """The requests a replica serves at once: what its engine reports, else its profile's ``parallel``,
    else ``saturation``."""
    e = engines.get(r.replica_id) if engines else None
    return (e.slots if e is not None else None) or r.slots or saturation


def order(
    replicas: list[ReplicaInfo],
    outstanding: Mapping[str, int],
    preferred: str | None,
    saturation: int,
    seed: int,
    engines: Mapping[str, EngineLoad] | None = None,
) -> list[ReplicaInfo]:
    """Replicas in the order to try: the affine one first when not saturated, then least loaded.

    A replica's slots are its profile's ``parallel`` (``saturation`` when unknown). Where ``engines``
    has a replica's report, the requests waiting in its engine add to its load and its KV usage
    breaks ties; elsewhere the load is this router's requests in flight alone. An engine its agent
    cannot reach goes last (still tried: it may be the only one) and keeps no prefix."""
    if len(replicas) < 2:
        return list(replicas)  # one way to go (most models have one replica): nothing to weigh

    def load(r: ReplicaInfo) -> tuple[bool, int, float, int]:
        rid = r.replica_id
        e = engines.get(rid) if engines else None
        busy = outstanding.get(rid, 0)
        if e is None:
            return False, busy, 0.0, _mix(hash(rid) + seed * _GOLDEN)
        return e.unreachable, busy + e.waiting, e.kv_usage or 0.0, _mix(hash(rid) + seed * _GOLDEN)

    ranked = sorted(replicas, key=load)
    if preferred is not None:
        for i, r in enumerate(ranked):
            if r.replica_id != preferred:
                continue
            e = engines.get(r.replica_id) if engines else None
            # Affinity lets go at the replica's slots, and at ``saturation`` for an engine with many: one
            # shared system prompt must not send a vLLM replica's 256 requests to it while others idle.
            room = min(slots_of(r, engines, saturation), saturation)
            if outstanding.get(r.replica_id, 0) < room and not (e and e.unreachable):
                return [r, *ranked[:i], *ranked[i + 1 :]]
    return ranked


def round_robin(replicas: list[ReplicaInfo], turn: int) -> list[ReplicaInfo]:
    """The baseline that ignores load and prefix: the replicas by id, rotated by ``turn`` (the request's
    number), so consecutive requests start at consecutive replicas."""
    ranked = sorted(replicas, key=lambda r: r.replica_id)
    k = turn % len(ranked) if ranked else 0
    return [*ranked[k:], *ranked[:k]]


def shuffled(replicas: list[ReplicaInfo], seed: int) -> list[ReplicaInfo]:
    """The baseline that picks at random: the replicas by id, shuffled by ``seed`` (the same seed, the
    same order)."""
    ranked = sorted(replicas, key=lambda r: r.replica_id)
    random.Random(seed).shuffle(ranked)
    return ranked


class Affinity:
    """prefix → replica that last served it; bounded, oldest forgotten first."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str | None) -> str | None:
        if key is None:
            return None
        rid = self._map.get(key)
        if rid is not None:
            self._map.move_to_end(key)
        return rid

    def put(self, key: str | None, replica_id: str) -> None:
        if key is None:
            return
        self._map[key] = replica_id
        self._map.move_to_end(key)
        if len(self._map) > self.size:
            self._map.popitem(last=False)
