"""Preemption (SPEC SCHED-7): which running replicas give way so that a model that fits nowhere can be
placed. Pure functions over plain data, tried by the reconcile pass only after plain placement failed.

The rules, each where it is decided:

- **who may give way to whom** (:func:`tier_of`): a lower class to a higher one, extras and minimums
  alike; within a class only a replica above its model's minimum, and only for a model below its
  own minimum; a higher class never to a lower — except that a model within its owner's quota
  guarantee (SCHED-8) takes back capacity other scopes borrowed beyond theirs, whatever its class.
  Never a critical model's minimum, a replica younger than :data:`MIN_AGE_S`, a replica of the
  winner's own model, nor one within another scope's guarantee.
  (llmgw places no replica across nodes, so "never a multi-node replica" has nothing to exclude.)
- **the order victims are taken in** (the tier, then :func:`_victim_order`): borrowed capacity taken
  back, idle on-demand replicas, lower classes' extras, the same class's extras, lower classes'
  minimums; within a tier capacity a scope borrowed beyond its guarantee first, then the longest
  unused, then the smallest.
- **the set** (:func:`find`): victims live on one node (freeing room elsewhere helps no one); at most
  :data:`MAX_VICTIMS`, tried on a copy of the node — nothing is stopped unless the whole set makes
  room — then pruned to what the placement needs. Of the nodes where a set works, the one giving up
  least wins: fewest victims, then the lowest tiers, then the placement's own score.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from collections.abc import Set as AbstractSet

import msgspec

from llmgw.events.schema.models import ModelSpec
from llmgw.services.scheduler.placement import Candidate, Choice, Need, check, place

RANK = {"opportunistic": 0, "standard": 1, "critical": 2}
MIN_AGE_S = 300.0  # a replica younger than this is never taken: it has not yet served its start's cost
MAX_VICTIMS = 3
HOLD_S = 300.0  # a victim's model waits this long (or until the winner is placed) before it is placed again
GRACE_S = 30.0  # the drain a victim gets

# The tiers, in the order victims are taken.
RECLAIMED, IDLE_ON_DEMAND, LOWER_EXTRA, SAME_EXTRA, LOWER_MINIMUM = range(5)
TIER_WORDS = (
    "capacity borrowed beyond its scope's guarantee",
    "idle on-demand",
    "extra replica of a lower class",
    "extra replica of its class",
    "lower class",
)


def class_of(spec: ModelSpec, min_replicas: int) -> str:
    """A model's capacity class: as declared; unset, on-demand models (min 0) are opportunistic and
    the rest standard."""
    if spec.capacity_class:
        return spec.capacity_class
    return "opportunistic" if min_replicas == 0 else "standard"


class ModelSide(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What preemption needs of a model whose replicas might give way."""

    name: str
    capacity_class: str
    extras: int  # how many of its running replicas are above its minimum
    on_demand_idle: bool = False  # min 0 and no request for a while: its replicas cost nobody a thing
    last_used: float = 0.0  # epoch seconds of its last request; 0: none seen


class Holder(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A running replica as a possible victim."""

    replica_id: str
    model: str
    node_id: str
    age_s: float
    cores: int = 0
    memory_bytes: int = 0
    gpus: list[int] = []
    protected: str = ""  # why it may not be taken for another scope ("within org:acme's guarantee")
    borrowed: bool = False  # its scope holds it beyond its guarantee: taken back first


class Winner(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    capacity_class: str
    below_minimum: bool  # fewer replicas than its own minimum (not just an on-demand model in use)
    # Within its owner's guarantee (SCHED-8): it takes back what others borrowed, whatever their class.
    reclaims: bool = False
    own_guarantees: frozenset[str] = frozenset()  # Holder.protected sentences of its own scopes


class Victim(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    holder: Holder
    capacity_class: str
    tier: int
    last_used: float = 0.0


class Preemption(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    victims: list[Victim]
    choice: Choice  # where the winner lands once the victims are gone (on a copy of the node)


def tier_of(winner: Winner, model: ModelSide, extra: bool, borrowed: bool = False) -> int | None:
    """The tier a replica of ``model`` gives way to ``winner`` in, or None when it may not.
    ``extra``: the replica counts above its model's minimum; ``borrowed``: its scope holds it beyond
    its guarantee. Age and protection are the caller's filter."""
    if model.name == winner.model:
        return None
    if model.capacity_class == "critical" and not extra:
        return None
    if borrowed and winner.reclaims:
        return RECLAIMED  # a scope within its guarantee takes back what was lent, of any class
    mine, theirs = RANK[model.capacity_class], RANK[winner.capacity_class]
    if mine > theirs:
        return None
    if mine == theirs:
        if not (extra and winner.below_minimum):
            return None
        return IDLE_ON_DEMAND if model.on_demand_idle else SAME_EXTRA
    if model.on_demand_idle:
        return IDLE_ON_DEMAND
    return LOWER_EXTRA if extra else LOWER_MINIMUM


def _size(h: Holder) -> tuple[int, int, int]:
    return (len(h.gpus), h.cores, h.memory_bytes)


def _victim_order(v: Victim) -> tuple[object, ...]:
    h = v.holder
    return (v.tier, not h.borrowed, v.last_used, _size(h), h.replica_id)


def _release(c: Candidate, victims: list[Victim]) -> Candidate:
    """``c`` as it would be with ``victims`` stopped."""
    return _release_holders(c, [v.holder for v in victims])


def _release_holders(c: Candidate, holders: list[Holder]) -> Candidate:
    if not holders:
        return c
    freed_gpus = {g for h in holders for g in h.gpus}
    return msgspec.structs.replace(
        c,
        reserved_cores=c.reserved_cores - sum(h.cores for h in holders),
        reserved_memory_bytes=c.reserved_memory_bytes - sum(h.memory_bytes for h in holders),
        reserved_gpus=[g for g in c.reserved_gpus if g not in freed_gpus],
        replicas=c.replicas - len(holders),
    )


def _eligible_on(
    node_holders: list[Holder],
    winner: Winner,
    side_of: Callable[[str], ModelSide | None],
    taken: AbstractSet[str],
    min_age_s: float,
) -> list[Victim]:
    """The replicas on one node that may give way to ``winner``, in the order they are taken.

    Which of a model's replicas count as its extras is decided per node: as many as the model has
    extras, the oldest first (the young are not taken anyway).
    """
    extras_left: dict[str, int] = {}
    out: list[Victim] = []
    for h in sorted(node_holders, key=lambda h: (-h.age_s, h.replica_id)):
        side = side_of(h.model)
        if side is None:
            continue
        left = extras_left.get(h.model, side.extras)
        extra = left > 0
        extras_left[h.model] = left - 1
        if h.replica_id in taken or h.age_s < min_age_s:
            continue
        if h.protected and h.protected not in winner.own_guarantees:
            continue  # within another scope's guarantee: never taken for this one
        tier = tier_of(winner, side, extra, h.borrowed)
        if tier is not None:
            out.append(Victim(holder=h, capacity_class=side.capacity_class, tier=tier, last_used=side.last_used))
    out.sort(key=_victim_order)
    return out


def _set_for(c: Candidate, need: Need, eligible: list[Victim], max_victims: int) -> list[Victim] | None:
    """The smallest set, taken in order then pruned, that makes room on ``c``; None when none of
    at most ``max_victims`` does."""
    if check(_release(c, eligible), need):
        return None  # not even all of them would do (or the node lacks something no stop frees)
    chosen: list[Victim] = []
    for v in eligible:
        chosen.append(v)
        if len(chosen) > max_victims:
            return None
        if not check(_release(c, chosen), need):
            break
    else:
        return None
    # Pruned: a victim taken early (a small idle one, say) may be needless once a bigger one went.
    for v in list(reversed(chosen)):
        rest = [x for x in chosen if x is not v]
        if not check(_release(c, rest), need):
            chosen = rest
    return chosen


def _could_take(c: Candidate, need: Need) -> bool:
    """Whether ``c`` empty could take the replica, on the plain numbers alone: most nodes of a large
    fleet fail this (another engine, no GPUs), and it costs nothing next to :func:`check`."""
    if c.engines is not None and need.engine not in c.engines:
        return False
    if need.gpus and len(c.gpus) < need.gpus:
        return False
    if c.cpus is not None and need.cores > c.cpus:
        return False
    return not (c.memory_total_bytes is not None and need.memory_bytes > c.memory_total_bytes)


def _tiebreak(seed: str, node_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}/{node_id}".encode(), digest_size=8).digest(), "big")


def find(
    candidates: dict[str, Candidate],
    need: Need,
    winner: Winner,
    holders_on: Callable[[str], list[Holder]],
    side_of: Callable[[str], ModelSide | None],
    *,
    seed: str,
    taken: AbstractSet[str] = frozenset(),
    max_victims: int = MAX_VICTIMS,
    min_age_s: float = MIN_AGE_S,
) -> Preemption | None:
    """The victims whose stopping lets one replica needing ``need`` be placed, or None. Pure.

    ``candidates`` are the nodes as placement sees them now; ``holders_on(node)`` the running replicas
    on a node that might give way, ``side_of(model)`` their model's side (both asked only for the
    nodes that could take the replica at all, so a large fleet is not walked whole); ``taken``
    replicas already given way in this pass.
    """
    best: tuple[tuple[object, ...], Preemption] | None = None
    for node_id in sorted(candidates):
        c = candidates[node_id]
        if c.unusable or not _could_take(c, need):
            continue  # not even an empty node would do (another engine, too small): nothing to weigh
        held = holders_on(node_id)
        if not held or check(_release_holders(c, held), need):
            continue
        eligible = _eligible_on(held, winner, side_of, taken, min_age_s)
        if not eligible:
            continue
        victims = _set_for(c, need, eligible, max_victims)
        if victims is None:
            continue
        freed = _release(c, victims)
        choice, _ = place([freed], need, seed)
        if choice is None:  # check() said it fits: place() agrees, but never trust one without the other
            continue
        score = choice.verdicts[0].score
        key = (
            len(victims),
            max(v.tier for v in victims),
            sum(v.tier for v in victims),
            -score,
            -_tiebreak(seed, node_id),
        )
        if best is None or key < best[0]:
            best = (key, Preemption(node_id=node_id, victims=victims, choice=choice))
    return best[1] if best else None
