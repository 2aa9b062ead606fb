"""Placement (SPEC SCHED-1): filters, then scores, then a seeded pick. Pure functions over plain data.

The pipeline, and why each stage sits where it does:

1. **filters** say, per node, what it lacks — in words a person reads ("has 8 CPUs with 2 free,
   needs 4"). Only data a node reported can rule it out: an old agent that reports no CPU count
   is not refused for CPUs (missing data constrains nothing).
2. **scores** rank the survivors, each in [0, 1] with a named weight: spreading one model's
   replicas across nodes first (availability), then nodes that already hold the weights, then
   packing GPUs (fewest free GPUs that fit) or balancing CPU nodes (fewest replicas). Spreading is
   a score, not a filter, so it is dropped when it is the only obstacle.
3. **the pick** breaks ties by a hash of the seed (the model and its replica count) and the node
   id, so the same input always gives the same decision, and a replay reproduces it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgspec

from llmgw.events.schema.models import Profile

GiB = 1024**3

# Score weights, named and kept in one place. Spreading comes first: a node with none of the
# model's replicas (spread 1) must beat one with any (spread ≤ ½) even when that one holds the
# weights and fits best, so W_SPREAD · ½ > W_WEIGHTS + W_FIT.
W_SPREAD = 8.0
W_WEIGHTS = 2.0
W_FIT = 1.0


class Need(msgspec.Struct, frozen=True, kw_only=True):
    """What one replica of a profile reserves. ``cores`` 0 on a llama.cpp profile: the threads rule's
    share of the node it lands on (:func:`cores_on`)."""

    engine: str
    cores: int = 0
    memory_bytes: int = 0
    gpus: int = 0
    gpu_min_memory_mb: int = 0
    disk_bytes: int = 0
    node_selector: dict[str, str] = {}


# Candidate, Verdict and Choice are gc=False: plain data that never forms a reference cycle, made
# by the thousand for every placement; the cyclic collector scanning them cost a fifth of the time.
class Candidate(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A node as placement sees it: what it has, what is reserved on it, what it holds.

    ``None`` means "not reported" and never rules a node out.
    """

    node_id: str
    unusable: str = ""  # "lost", "cordoned", … : why nothing may be placed here at all
    engines: list[str] | None = None
    labels: dict[str, str] = {}
    cpus: int | None = None
    reserved_cores: int = 0
    memory_total_bytes: int | None = None
    reserved_memory_bytes: int = 0
    gpus: dict[int, int] = {}  # index -> memory MB, for every GPU on the node
    reserved_gpus: list[int] = []
    disk_free_bytes: int | None = None
    model_replicas: int = 0  # replicas of the model being placed
    replicas: int = 0  # all replicas
    has_weights: bool = False

    @property
    def free_cores(self) -> int | None:
        return None if self.cpus is None else self.cpus - self.reserved_cores

    @property
    def free_memory_bytes(self) -> int | None:
        return None if self.memory_total_bytes is None else self.memory_total_bytes - self.reserved_memory_bytes

    def free_gpus(self, min_memory_mb: int = 0) -> list[int]:
        return sorted(i for i, mb in self.gpus.items() if i not in self.reserved_gpus and mb >= min_memory_mb)


class Verdict(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    node_id: str
    reasons: list[str]  # empty when the node fits
    score: float = 0.0
    scores: dict[str, float] = {}

    @property
    def fits(self) -> bool:
        return not self.reasons


class Choice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    node_id: str
    gpus: list[int]
    verdicts: list[Verdict]
    fitting: int = 0  # how many of the verdicts fit


def cores_on(need: Need, cpus: int | None) -> int:
    """The cores a replica reserves on a node with ``cpus``: the profile's own; else, for llama.cpp, what
    its engine will use there — the agent's threads rule, half the node's CPUs, at least 1 — so that a
    replica never uses cores nobody reserved (0 while the node has not said how many it has)."""
    if need.cores:
        return need.cores
    if need.engine == "llamacpp" and cpus:
        return max(1, cpus // 2)
    return 0


def profile_order(profiles: list[Profile]) -> list[int]:
    """The order placement tries a model's profiles in (CAT-2), as indexes: highest ``priority`` first,
    then highest ``weight``, then as listed — so the same model always prefers the same profile."""
    return sorted(range(len(profiles)), key=lambda i: (-profiles[i].priority, -profiles[i].weight, i))


def need_of(profile: Profile) -> Need:
    gpus = profile.gpus.count if profile.gpus else 0
    return Need(
        engine=profile.engine,
        cores=profile.cpu_cores or 0,
        memory_bytes=int((profile.min_memory_gb or 0) * GiB),
        gpus=gpus,
        gpu_min_memory_mb=int((profile.gpus.min_memory_gb if profile.gpus else 0) * 1024),
        disk_bytes=int((profile.min_disk_gb or 0) * GiB),
        node_selector=dict(profile.node_selector),
    )


def _gb(n: int) -> str:
    return f"{n / GiB:.1f} GB"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


# -- filters: each returns the reason a node cannot take the replica, or None --------------------


def check(c: Candidate, need: Need) -> list[str]:
    """Every reason ``c`` cannot take a replica needing ``need``; empty when it can."""
    return _check(c, need, {})


def _check(c: Candidate, need: Need, said: dict[tuple[object, ...], str]) -> list[str]:
    """:func:`check`, with the sentences already written in this evaluation kept in ``said``.

    Runs for every node on every placement: plain arithmetic first, and a sentence only for what
    is lacking. Nodes of one shape lack the same things in the same words (a CPU node asked for a
    GPU, a full node of a common size), so each sentence is written once per evaluation — the
    per-shape memo of feasibility, without a shape key to keep.
    """
    if c.unusable:
        return [c.unusable]
    reasons: list[str] = []
    engines = c.engines
    if engines is not None and need.engine not in engines:
        key: tuple[object, ...] = ("engine", *engines)
        if (text := said.get(key)) is None:
            text = said[key] = f"cannot run {need.engine} (engines: {', '.join(engines) or 'none'})"
        reasons.append(text)
    if need.node_selector:
        labels = c.labels
        for k, value in sorted(need.node_selector.items()):
            has = labels.get(k)
            if has != value:
                key = ("label", k, has)
                if (text := said.get(key)) is None:
                    text = said[key] = f"label {k}={value} missing" + (f" (has {k}={has})" if k in labels else "")
                reasons.append(text)
    cpus = c.cpus
    if cpus is not None and (cores := cores_on(need, cpus)):
        free = cpus - c.reserved_cores
        if free < cores:
            key = ("cpu", cpus, free, cores)
            if (text := said.get(key)) is None:
                text = said[key] = f"has {_count(cpus, 'CPU')} with {max(free, 0)} free, needs {cores}"
            reasons.append(text)
    total = c.memory_total_bytes
    if need.memory_bytes and total is not None:
        free_mem = total - c.reserved_memory_bytes
        if free_mem < need.memory_bytes:
            key = ("memory", total, free_mem)
            if (text := said.get(key)) is None:
                text = said[key] = (
                    f"has {_gb(total)} memory with {_gb(max(free_mem, 0))} free, needs {_gb(need.memory_bytes)}"
                )
            reasons.append(text)
    if need.gpus:
        fitting = len(c.free_gpus(need.gpu_min_memory_mb)) if c.gpus else 0
        if fitting < need.gpus:
            key = ("gpu", len(c.gpus), fitting)
            if (text := said.get(key)) is None:
                size = f" with ≥ {need.gpu_min_memory_mb / 1024:.0f} GB" if need.gpu_min_memory_mb else ""
                text = said[key] = f"has {_count(len(c.gpus), 'GPU')}, {fitting} free{size}, needs {need.gpus}"
            reasons.append(text)
    disk = c.disk_free_bytes
    if need.disk_bytes and disk is not None and disk < need.disk_bytes:
        reasons.append(f"has {_gb(disk)} disk free, needs {_gb(need.disk_bytes)}")
    return reasons


# -- scores: each in [0, 1] ----------------------------------------------------------------------


def scores(c: Candidate, need: Need) -> dict[str, float]:
    out = {
        "spread": 1.0 / (1 + c.model_replicas),
        "weights": 1.0 if c.has_weights else 0.0,
    }
    if need.gpus:
        free = len(c.free_gpus(need.gpu_min_memory_mb))
        # Pack: fewest free GPUs that fit, counted, not as a share of the node's GPUs (3 free of 4
        # packs tighter than 4 free of 8).
        out["fit"] = 1.0 / (1 + free - need.gpus)
    else:
        out["fit"] = 1.0 / (1 + c.replicas)  # balance CPU nodes: fewest replicas
    return out


WEIGHTS = {"spread": W_SPREAD, "weights": W_WEIGHTS, "fit": W_FIT}


def _tiebreak(seed: str, node_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}/{node_id}".encode(), digest_size=8).digest(), "big")


def _node_id(c: Candidate) -> str:
    return c.node_id


def evaluate(candidates: list[Candidate], need: Need) -> list[Verdict]:
    # Runs for every node of every placement: names bound once, and the scores of a CPU profile
    # (the common case) computed inline — the same formulas as `scores`, which a test holds equal.
    verdicts: list[Verdict] = []
    add = verdicts.append
    gpu = need.gpus > 0
    said: dict[tuple[object, ...], str] = {}
    rounded: dict[float, float] = {}  # round() is slow, and the nodes' totals take few values
    for c in sorted(candidates, key=_node_id):
        reasons = _check(c, need, said)
        if reasons:
            add(Verdict(node_id=c.node_id, reasons=reasons))
            continue
        if gpu:
            parts = scores(c, need)
        else:
            parts = {
                "spread": 1.0 / (1 + c.model_replicas),
                "weights": 1.0 if c.has_weights else 0.0,
                "fit": 1.0 / (1 + c.replicas),
            }
        # The weighted sum spelled out: same terms, same order as summing WEIGHTS over the parts.
        total = W_SPREAD * parts["spread"] + W_WEIGHTS * parts["weights"] + W_FIT * parts["fit"]
        if (score := rounded.get(total)) is None:
            score = rounded[total] = round(total, 6)
        add(Verdict(node_id=c.node_id, reasons=reasons, score=score, scores=parts))
    return verdicts


def place(candidates: list[Candidate], need: Need, seed: str) -> tuple[Choice | None, list[Verdict]]:
    """The node (and GPUs) for one replica, or None; with every node's verdict either way."""
    verdicts = evaluate(candidates, need)
    return pick(verdicts, lambda node_id: next(c for c in candidates if c.node_id == node_id), need, seed), verdicts


def pick(verdicts: list[Verdict], node_of: Callable[[str], Candidate], need: Need, seed: str) -> Choice | None:
    """The best of ``verdicts`` (highest score, ties broken by the seeded hash), and its GPUs; None when
    no node fits. Apart from :func:`evaluate`, so that placing many replicas of one model in a pass
    re-evaluates only the node the last one took (``node_of`` finds a verdict's candidate)."""
    top = -1.0
    tied: list[Verdict] = []
    fitting = 0
    for v in verdicts:
        if v.reasons:
            continue
        fitting += 1
        if v.score > top:
            top, tied = v.score, [v]
        elif v.score == top:
            tied.append(v)
    if not tied:
        return None
    # Hashed only for the nodes that tie.
    best = tied[0] if len(tied) == 1 else max(tied, key=lambda v: _tiebreak(seed, v.node_id))
    gpus: list[int] = []
    if need.gpus:
        gpus = node_of(best.node_id).free_gpus(need.gpu_min_memory_mb)[: need.gpus]
    return Choice(node_id=best.node_id, gpus=gpus, verdicts=verdicts, fitting=fitting)


def reserve(c: Candidate, need: Need, gpus: list[int], model_replica: bool = True) -> Candidate:
    """``c`` with one more replica's reservation: so several placements in one pass never over-commit."""
    return msgspec.structs.replace(
        c,
        reserved_cores=c.reserved_cores + cores_on(need, c.cpus),
        reserved_memory_bytes=c.reserved_memory_bytes + need.memory_bytes,
        reserved_gpus=[*c.reserved_gpus, *gpus],
        model_replicas=c.model_replicas + (1 if model_replica else 0),
        replicas=c.replicas + 1,
    )


def summarise(verdicts: list[Verdict], limit: int = 6) -> str:
    """One sentence for "no placement": each node and what it lacks."""
    if not verdicts:
        return "no nodes have registered: start an agent (`llmgw agent`) or check that agents reach NATS"
    parts = [f"{v.node_id}: {'; '.join(v.reasons)}" for v in verdicts[:limit]]
    more = f"; and {len(verdicts) - limit} more" if len(verdicts) > limit else ""
    return "no node fits — " + " | ".join(parts) + more
