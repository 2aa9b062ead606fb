"""Replica choice (SPEC GW-6): least outstanding requests, with prefix affinity until saturation.

Requests that share a prompt prefix go to the replica that served it last — its KV cache likely
holds the prefix — unless that replica is saturated (as many requests in flight as it has
slots), when the preference is dropped. Pure: the caller passes the load and a seed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from llmgw.services.router.state import ReplicaInfo

PREFIX_CHARS = 512


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


def order(
    replicas: list[ReplicaInfo],
    outstanding: dict[str, int],
    preferred: str | None,
    saturation: int,
    seed: int,
) -> list[ReplicaInfo]:
    """Replicas in the order to try: the affine one first when not saturated, then least loaded."""

    def load(r: ReplicaInfo) -> tuple[int, int]:
        return outstanding.get(r.replica_id, 0), _mix(hash(r.replica_id) + seed * _GOLDEN)

    ranked = sorted(replicas, key=load)
    if preferred is not None:
        for i, r in enumerate(ranked):
            if r.replica_id == preferred and outstanding.get(r.replica_id, 0) < saturation:
                return [r, *ranked[:i], *ranked[i + 1 :]]
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
