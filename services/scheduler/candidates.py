"""The cluster as placement sees it: a :class:`~llmgw.services.scheduler.placement.Candidate` per node.

Built from a :class:`ClusterState` in two layers, because a pass places many models: the nodes with
what their replicas hold (:func:`node_view`, for no model in particular, once per pass), then the
fields that depend on the model — its replicas on each node (spread), and whether the node holds
its weights (:func:`for_model`). :func:`candidates` does both, for one question (`ctl explain`, tests).
"""

from __future__ import annotations

import os

import msgspec

from llmgw.events.schema.models import mirror_ref
from llmgw.services.scheduler.placement import Candidate
from llmgw.services.scheduler.state import ClusterState


def node_view(state: ClusterState) -> dict[str, Candidate]:
    """Every registered node with what its replicas hold, for no model in particular."""
    out: dict[str, Candidate] = {}
    for n in state.nodes.values():
        if not n.registered or n.capacity is None:
            continue
        held = [r for r in state.replicas_on(n.id) if r.active or r.state == "draining"]
        hb = n.heartbeat
        unusable = ""
        if n.lost:
            unusable = "lost (no heartbeat)"
        elif n.draining:
            unusable = "draining"
        elif n.cordoned:
            unusable = "cordoned" + (f" ({n.cordon_reason})" if n.cordon_reason else "")
        cap = n.capacity
        out[n.id] = Candidate(
            node_id=n.id,
            unusable=unusable,
            engines=list(cap.engines),
            labels=dict(cap.labels),
            cpus=cap.cpus,
            reserved_cores=sum(r.cores for r in held),
            memory_total_bytes=cap.memory_total_bytes,
            reserved_memory_bytes=sum(r.memory_bytes for r in held),
            gpus={g.index: g.memory_total_mb for g in cap.gpus},
            reserved_gpus=[i for r in held for i in r.gpus],
            disk_free_bytes=hb.disk_free_bytes if hb else None,
            replicas=len(held),
        )
    return out


def weights_index(state: ClusterState) -> dict[str, set[str]]:
    """Model name → nodes holding its weights: a weights entry ``a/b/c`` holds ``a/b/c``, ``a/b`` and ``a``
    (the same test as ``w == model or w.startswith(model + "/")``, done once per pass, not per model)."""
    out: dict[str, set[str]] = {}
    for n in state.nodes.values():
        if n.heartbeat is None:
            continue
        for w in n.heartbeat.weights:
            out.setdefault(w, set()).add(n.id)
            i = w.find("/")
            while i >= 0:
                out.setdefault(w[:i], set()).add(n.id)
                i = w.find("/", i + 1)
    return out


def for_model(
    view: dict[str, Candidate], state: ClusterState, model: str, weights: dict[str, set[str]]
) -> dict[str, Candidate]:
    """``view`` with the fields that depend on the model: its replicas on each node, its weights."""
    out = dict(view)
    counts: dict[str, int] = {}
    for r in state.replicas_of(model):
        if r.active and r.node_id in out:
            counts[r.node_id] = counts.get(r.node_id, 0) + 1
    for node_id, k in counts.items():
        out[node_id] = msgspec.structs.replace(out[node_id], model_replicas=k)
    holders = set(weights.get(model, ()))
    m = state.models.get(model)
    if m is not None:
        # A model served from the mirror is held under its source's MODEL/VERSION/FILE, whatever the
        # catalog calls it.
        try:
            ref = mirror_ref(m.spec.source)
        except ValueError:
            ref = None
        if ref:
            holders |= weights.get(ref, set())
        elif m.spec.source.startswith("/"):
            # A local source: nodes report the weight files under their model directories by path.
            holders |= weights.get(os.path.normpath(m.spec.source), set())
    for node_id in holders:
        if node_id in out:
            out[node_id] = msgspec.structs.replace(out[node_id], has_weights=True)
    return out


def candidates(state: ClusterState, model: str) -> dict[str, Candidate]:
    """Every registered node as placement sees it for one more replica of ``model``."""
    return for_model(node_view(state), state, model, weights_index(state))
