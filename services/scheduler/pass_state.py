"""What one reconcile pass learns as it goes (:class:`PassState`), so that later steps count earlier ones.

A pass decides model after model against the same :class:`ClusterState`, which it never changes.
What it has decided so far lives here instead: the replicas it failed and the nodes it found lost,
the nodes as placement sees them with this pass's reservations made (so one pass never
over-commits a node), what this pass's preemptions took, and what each quota scope holds counting
this pass's placements. Everything is built lazily, on the first step that asks: most passes at rest
place nothing and preempt nothing.

The earmarks live here too: room that replicas gave up on a node for a winner (SCHED-7) is the
winner's until it is served or the hold ends (:meth:`PassState.earmarks`, :func:`winner_served`).
"""

from __future__ import annotations

import msgspec

from llmgw.events.schema import models as M
from llmgw.services.scheduler import preemption as PRE
from llmgw.services.scheduler.candidates import for_model, node_view, weights_index
from llmgw.services.scheduler.placement import Candidate, Need, reserve
from llmgw.services.scheduler.quota import Ledger, Shares
from llmgw.services.scheduler.state import ClusterState
from llmgw.services.scheduler.vocabulary import Clock, Config


class PassState:
    """What one pass learns as it goes: replicas failed, nodes lost, and the nodes as placement
    sees them — built once, on the first placement, then updated with each reservation the pass
    makes, so later placements count earlier ones and one pass never over-commits a node."""

    def __init__(self, state: ClusterState, now: float = 0.0) -> None:
        self.state = state
        self.now = now  # epoch seconds: which preemption holds still last
        self.failed_now: set[str] = set()
        self.lost_now: set[str] = set()
        self.draining_nodes = {n.id for n in state.nodes.values() if n.draining}
        self._view: dict[str, Candidate] | None = None
        self._weights: dict[str, set[str]] = {}
        self.preempted: set[str] = set()  # replicas given way in this pass: not taken twice
        self._holders_on: dict[str, list[PRE.Holder]] = {}
        self._sides: dict[str, PRE.ModelSide | None] = {}
        self._shares: Shares | None = None
        self._gave_way: dict[str, list[M.ModelPreempted]] | None = None
        self._earmarks: dict[str, str] | None = None
        self._quota: Ledger | None = None

    @property
    def quota(self) -> Ledger:
        """What each scope holds, counting this pass's placements (SCHED-8): built on the first placement."""
        if self._quota is None:
            self._quota = Ledger(self.state)
        return self._quota

    @property
    def view(self) -> dict[str, Candidate]:
        """Every node as placement sees it, for no model in particular, with this pass's lost nodes and
        reservations: built on the first placement."""
        if self._view is None:
            self._view = node_view(self.state)
            for node_id in self.lost_now:
                if node_id in self._view:
                    self._view[node_id] = msgspec.structs.replace(self._view[node_id], unusable="lost (no heartbeat)")
            self._weights = weights_index(self.state)
        return self._view

    def candidates(self, model: str) -> dict[str, Candidate]:
        """The nodes as the next replica of ``model`` sees them: :attr:`view`, its replicas and weights,
        and the nodes earmarked for other models unusable."""
        view = self.view
        cs = for_model(view, self.state, model, self._weights)
        for node_id, winner in self.earmarks().items():
            # The room replicas gave up on a node is its winner's until it is placed (or the hold ends):
            # without this, a model that comes earlier in the pass takes it and the winner preempts again.
            if winner != model and node_id in cs and not cs[node_id].unusable:
                why = f"held for {winner}: replicas gave way there for it"
                cs[node_id] = msgspec.structs.replace(cs[node_id], unusable=why)
        return cs

    def earmarks(self) -> dict[str, str]:
        """Node → the model replicas gave way there for, while that model is not placed and its hold lasts."""
        if self._earmarks is None:
            self._earmarks = {}
            for m in self.state.models.values():
                for pre in m.gave_way:
                    if self.now < pre.held_until and not winner_served(self.state, pre):
                        self._earmarks[pre.node_id] = pre.for_model
        return self._earmarks

    def reserve(self, node_id: str, need: Need, gpus: list[int]) -> None:
        """Count a placement this pass made on ``node_id``, for every later placement of the pass."""
        self.view[node_id] = reserve(self.view[node_id], need, gpus, model_replica=False)

    def holders_on(self, node_id: str, clock: Clock) -> list[PRE.Holder]:
        """The running replicas on a node as possible victims (SCHED-7): built per node, on the first
        preemption that asks about it (most passes try none, and most nodes cannot take the winner)."""
        held = self._holders_on.get(node_id)
        if held is None:
            if self._shares is None and self.state.quotas:
                self._shares = Shares(self.state)
            shares = self._shares
            held = self._holders_on[node_id] = []
            for r in self.state.replicas_on(node_id):
                if not r.active or r.id in self.failed_now:
                    continue
                protected, borrowed = shares.share(r) if shares else ("", False)
                held.append(
                    PRE.Holder(
                        replica_id=r.id,
                        model=r.model,
                        node_id=node_id,
                        age_s=clock.epoch - r.placed_at,
                        cores=r.cores,
                        memory_bytes=r.memory_bytes,
                        gpus=list(r.gpus),
                        protected=protected,
                        borrowed=borrowed,
                    )
                )
        return held

    def side_of(self, model: str, clock: Clock, cfg: Config) -> PRE.ModelSide | None:
        """What preemption needs of a model whose replicas might give way; None for one not in the catalog."""
        if model not in self._sides:
            m = self.state.models.get(model)
            side = None
            if m is not None:
                live = sum(1 for r in self.state.replicas_of(model) if r.active and r.id not in self.failed_now)
                used = self.state.demand.get(model)
                side = PRE.ModelSide(
                    name=model,
                    capacity_class=PRE.class_of(m.spec, m.min),
                    extras=max(live - m.min, 0),
                    on_demand_idle=m.min == 0 and (used is None or clock.epoch - used >= cfg.preempt_idle_s),
                    last_used=used or 0.0,
                )
            self._sides[model] = side
        return self._sides[model]

    def gave_way_to(self, model: str, now: float) -> list[M.ModelPreempted]:
        """The preemptions made for ``model`` whose hold still lasts."""
        if self._gave_way is None:
            self._gave_way = {}
            for m in self.state.models.values():
                for pre in m.gave_way:
                    if now < pre.held_until:
                        self._gave_way.setdefault(pre.for_model, []).append(pre)
        return self._gave_way.get(model, [])


def winner_served(state: ClusterState, pre: M.ModelPreempted) -> bool:
    """Whether the model a preemption made room for has what it was short of (or is gone): as many
    running replicas as its minimum (one, on demand). Not merely "a replica placed since": a winner
    short by two is placed once in the very pass that preempts for its second, and that placement
    must not end the second preemption's hold."""
    m = state.models.get(pre.for_model)
    if m is None:
        return True
    running = sum(1 for r in state.replicas_of(pre.for_model) if r.active)
    return running >= max(m.min, 1)
