"""A day of churn for the scheduler (SCHED-7, SCHED-8): preemptions, guarantees and pass times.

    .venv/bin/python -m tests.bench.churn [--hours 24] [--seed 7] [--nodes 100] [--scenario both] [--json]

A discrete-time simulation over the scheduler's pure pass, driven through ``tests/scheduler_world.py``
(facts folded into a ClusterState; each pass committed as the events the shell would write): a pass
every 10 simulated seconds, every node heartbeating except those lost. A fleet of mixed shapes
(CPU nodes, L4, A100×4 and H100×8 GPU nodes), 10 tenants (5 orgs of 2 teams) each with a quota
guarantee of GPUs and cores, and about 6 models per tenant of mixed classes (critical, standard,
opportunistic, on-demand), owned by the teams. A simulated agent answers the scheduler:
``replica.placed`` → ``replica.starting`` at the next pass, ``replica.ready`` 20–60 s later (GPU
engines 60–180 s); ``replica.stop_requested`` → ``replica.stopped`` after a few seconds, never
later than the drain grace. Over the day: models added and removed, scaled up and down (load),
nodes lost and returning, on-demand models' requests coming and going (``state.demand``).

Two scenarios, the same churn (same seed): **enough** capacity (the guarantees sum to 75% of the
fleet's GPUs and cores) and **overcommitted** (150%). What it reports, and how it is counted:

- **preemptions**: each winner's ``Preempt`` decisions in a pass, and the replicas given way, by the victim's class
  (a model with min 0 counts as on-demand). A preemption is **needed** when the same pass with
  preemption off (``Config(preempt=False)``) leaves the winner unplaceable (``Blocked``): no node could
  take its replica without the victims. It is **wasted** when the winner has no replica placed
  between the preemption and the end of its hold (``held_until``): victims stopped for nothing.
  **Placed elsewhere**: the winner was placed, but not on the node its victims left; **back and
  forth**: the winner had given way to the victim's model within the hour before.
- **below guarantee**: a tenant is below its guarantee at a pass when, after the pass is committed,
  one of its models holds fewer placed/starting/ready replicas than it wants (its min; 1 for an
  on-demand model in use) and one more of them would still fit within the tenant's guarantee
  (``quota._within``, the rule ``guarantee_room`` applies). Each such pass counts its 10 s; the first
  10 simulated minutes (the fleet filling from empty) are not counted. Each is put down to a cause:
  what the pass decided for the short model (``preempting``; ``victims draining``; ``held back after
  giving way`` itself), or, when it was blocked, whether the pass would
  have made room with replicas of any age, or with up to 20 victims on a node, or not at all.
- **overcommits**: after every pass, no node's placed, starting, ready and draining replicas reserve
  more cores, memory or GPUs than it has (or one GPU twice).
- **wall time** of the whole simulation, and the median and p90 of the reconcile pass alone.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Iterable

import msgspec

from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.services.scheduler import quota as QU
from llmgw.services.scheduler.placement import need_of
from llmgw.services.scheduler.reconcile import reconcile, wanted_replicas
from llmgw.services.scheduler.vocabulary import Blocked, Config, Decision, Preempt, Stop, Waiting
from tests.scheduler_world import (
    CPU_8C_32G,
    CPU_16C_64G,
    CPU_64C_256G,
    GPU_A100X4,
    GPU_H100X8,
    GPU_L4X1,
    T0,
    World,
    shaped,
    spec,
)
from tests.test_quota_rules import quota, tree

GiB = 1024**3
CFG = Config()
NO_PREEMPT = Config(preempt=False)
SCENARIOS = {"enough": 0.75, "overcommitted": 1.5}  # what the guarantees sum to, as a share of the fleet

# The fleet's mix (old agents left out: a node that reports no size constrains nothing, and "enough
# capacity" must mean something).
FLEET = (
    (CPU_16C_64G, 0.45),
    (CPU_8C_32G, 0.15),
    (CPU_64C_256G, 0.12),
    (GPU_L4X1, 0.12),
    (GPU_A100X4, 0.10),
    (GPU_H100X8, 0.06),
)


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    cores: int
    mem: float
    gpus: int = 0
    gpu_mem: float = 0.0

    @property
    def engine(self) -> str:
        return "vllm" if self.gpus else "llamacpp"


CPU_SHAPES = (
    ModelShape(name="cpu4", cores=4, mem=8),
    ModelShape(name="cpu8", cores=8, mem=16),
    ModelShape(name="cpu2", cores=2, mem=4),
)
GPU_SHAPES = (
    ModelShape(name="gpu1", cores=4, mem=16, gpus=1, gpu_mem=20),
    ModelShape(name="gpu2", cores=4, mem=16, gpus=2, gpu_mem=40),
    ModelShape(name="gpu4", cores=4, mem=32, gpus=4, gpu_mem=80),
)
CLASSES = (("critical", 0.15), ("standard", 0.45), ("opportunistic", 0.2), ("on-demand", 0.2))


class Params(msgspec.Struct, frozen=True, kw_only=True):
    scenario: str = "enough"
    hours: float = 24.0
    seed: int = 7
    nodes: int = 100
    orgs: int = 5  # 2 teams each: the tenants
    models_per_tenant: int = 6
    tick_s: float = 10.0
    warmup_s: float = 600.0
    # Mean simulated seconds between churn events of each kind.
    scale_every_s: float = 30.0  # some model's load changes
    load: float = 0.9  # what the models want at rest, as a share of the fleet's GPUs and cores
    swap_every_s: float = 2400.0  # a model removed and another added
    loss_every_s: float = 14400.0
    demand_every_s: float = 900.0  # an on-demand model's requests start or stop


class Plan(msgspec.Struct, kw_only=True):
    """A model as the simulation drives it: the tenant that owns it and the load it swings around."""

    name: str
    tenant: str
    kind: str  # critical | standard | opportunistic | on-demand
    shape: ModelShape
    base: int  # min replicas at rest (0 for on-demand)
    in_use: bool = False  # on-demand: requests come now


class Preemption(msgspec.Struct, kw_only=True):
    t: float
    winner: str
    winner_class: str
    node_id: str
    victims: list[tuple[str, str]]  # (replica id, victim kind)
    held_until: float  # epoch
    needed: bool
    victim_models: list[str] = []
    back_and_forth: bool = False  # its winner gave way to a victim's model within the hour before
    placed_t: float | None = None
    elsewhere: bool = False  # placed, but not on the node its victims left: they stopped for nothing
    wasted: str = ""  # why, once the hold ended with no winner placed


class TenantRow(msgspec.Struct, kw_only=True):
    tenant: str
    guarantee_gpus: int
    guarantee_cores: int
    minutes_below: float = 0.0
    longest_below_s: float = 0.0
    models_below: dict[str, float] = {}  # model -> seconds it was the one short within the guarantee
    causes: dict[str, float] = {}  # why (see Churn._cause) -> seconds


class Report(msgspec.Struct, kw_only=True):
    scenario: str
    guarantee_share: float
    hours: float
    seed: int
    nodes: int
    fleet_gpus: int
    fleet_cores: int
    tenants: int
    models_at_start: int
    models_added: int
    models_removed: int
    scalings: int
    nodes_lost: int
    demand_changes: int
    passes: int
    wanted_gpus: tuple[float, float]  # (mean, peak) of what the models want, as a share of the fleet's GPUs
    wanted_cores: tuple[float, float]
    replica_minutes_short: dict[str, float]  # by kind: replicas wanted and not placed, times minutes
    preemptions: int
    replicas_given_way: dict[str, int]
    needed: int
    back_and_forth: int
    winners_placed: int
    placed_elsewhere: int
    wasted: int
    wasted_why: list[str]
    open_at_end: int  # preemptions whose hold had not ended when the day did
    tenant_rows: list[TenantRow]
    overcommits: list[str]
    wall_s: float
    pass_median_ms: float
    pass_p90_ms: float
    pass_max_ms: float


class Churn:
    """One simulated day: :meth:`run` returns the :class:`Report`."""

    def __init__(self, p: Params) -> None:
        self.p = p
        self.share = SCENARIOS[p.scenario]
        self.rnd = random.Random(p.seed)  # the churn: the same in every scenario
        self.agent_rnd = random.Random(p.seed + 1)  # the engines' timings, which follow the decisions
        self.w = World()
        self.plans: dict[str, Plan] = {}
        self.tenants: list[str] = []  # paths, "o0/t1"
        self.lost: dict[str, float] = {}  # node -> t it returns
        self.starting: dict[str, float] = {}  # replica -> t of replica.starting
        self.ready_at: dict[str, float] = {}  # replica -> t of replica.ready
        self.stop_at: dict[str, float] = {}  # replica -> t of replica.stopped
        self.preemptions: list[Preemption] = []
        self.overcommits: list[str] = []
        self.pass_s: list[float] = []
        self.short: dict[str, float] = {}  # kind -> replica-minutes short of what its models want
        self.wanted: list[tuple[float, float]] = []  # per pass: what the models want, as shares of the fleet
        self.counts = {"added": 0, "removed": 0, "scalings": 0, "lost": 0, "demand": 0}
        self._model_n = 0
        self._below_since: dict[str, float] = {}
        self.rows: dict[str, TenantRow] = {}
        self.fleet_gpus = self.fleet_cores = 0

    # -- the world at t = 0 ------------------------------------------------------------------------

    def setup(self) -> None:
        counts = _spread(self.p.nodes, [s for _, s in FLEET])
        for (shape, _), k in zip(FLEET, counts, strict=True):
            for i in range(k):
                self.w.add(shaped(f"{shape.name}-{i}", shape))
                self.fleet_gpus += shape.gpus
                self.fleet_cores += shape.cpus or 0
        paths = [f"o{o}" for o in range(self.p.orgs)]
        self.tenants = [f"o{o}/t{t}" for o in range(self.p.orgs) for t in range(2)]
        self.w.add(tree(*paths, *self.tenants))
        n = len(self.tenants)
        g_gpus = max(1, int(self.fleet_gpus * self.share / n))
        g_cores = max(4, int(self.fleet_cores * self.share / n))
        for path in self.tenants:
            self.w.add(quota(path, gpus=g_gpus, cores=g_cores))
            self.rows[path] = TenantRow(tenant=path, guarantee_gpus=g_gpus, guarantee_cores=g_cores)
        # What each tenant's models want at rest: its share of ``load`` of the fleet, whatever the
        # guarantees say, so that both scenarios run the same load.
        want_gpus = self.fleet_gpus * self.p.load / n
        want_cores = self.fleet_cores * self.p.load / n
        for path in self.tenants:
            for _ in range(self.p.models_per_tenant):
                self._add_model(path, want_gpus, want_cores, at_start=True)

    def _add_model(self, tenant: str, want_gpus: float, want_cores: float, *, at_start: bool = False) -> None:
        """A model for ``tenant``: its base load a share of the tenant's want; about a third are GPU models
        (fewer on a fleet with few GPUs, where even one replica each would want more than there is)."""
        self._model_n += 1
        kind = _pick(self.rnd, CLASSES)
        per = self.p.models_per_tenant
        gpu_share = min(0.35, want_gpus / (per * 2.5))
        gpu = self.rnd.random() < gpu_share and kind != "on-demand"
        shape = self.rnd.choice(GPU_SHAPES if gpu else CPU_SHAPES)
        if kind == "on-demand":
            base = 0
        elif gpu:
            base = max(1, round(want_gpus / (per * gpu_share) / shape.gpus * self.rnd.uniform(0.5, 1.2)))
        else:
            base = max(1, round(want_cores / (per * 0.65) / shape.cores * self.rnd.uniform(0.7, 1.5)))
        name = f"{tenant.replace('/', '-')}-{shape.name}-{self._model_n}"
        plan = Plan(name=name, tenant=tenant, kind=kind, shape=shape, base=base)
        self.plans[name] = plan
        s = spec(
            name,
            base,
            max=base,
            cores=shape.cores,
            mem=shape.mem,
            gpus=shape.gpus,
            gpu_mem=shape.gpu_mem,
            engine=shape.engine,
            cls=None if kind == "on-demand" else kind,
            owner=tenant,
        )
        self.w.emit(M.AGGREGATE, name, M.ModelAdded(spec=s))
        if not at_start:
            self.counts["added"] += 1

    # -- churn ----------------------------------------------------------------------------------------

    def _chance(self, every_s: float) -> bool:
        return self.rnd.random() < self.p.tick_s / every_s

    def daily(self) -> float:
        """The day's load around the models' rest: 1 at the start, 1.25 six hours in, 0.75 at eighteen."""
        return 1.0 + 0.25 * math.sin(2 * math.pi * self.w.t / 86400)

    def churn(self) -> None:
        w, rnd = self.w, self.rnd
        if self._chance(self.p.scale_every_s):
            plans = [p for p in self.plans.values() if p.kind != "on-demand"]
            if plans:
                plan = rnd.choice(plans)
                k = max(1, round(plan.base * self.daily() * rnd.uniform(0.6, 1.4)))
                w.emit(M.AGGREGATE, plan.name, M.ModelScaled(min=k, max=k))
                self.counts["scalings"] += 1
        if self._chance(self.p.swap_every_s):
            gone = rnd.choice(sorted(self.plans))
            w.emit(M.AGGREGATE, gone, M.ModelRemoved())
            tenant = self.plans.pop(gone).tenant
            self.counts["removed"] += 1
            n = len(self.tenants)
            self._add_model(tenant, self.fleet_gpus * self.p.load / n, self.fleet_cores * self.p.load / n)
        if self._chance(self.p.loss_every_s):
            up = sorted(set(w.beats) - set(self.lost))
            if up:
                node_id = rnd.choice(up)
                self.lost[node_id] = w.t + rnd.uniform(300, 3600)
                self.counts["lost"] += 1
        for node_id, back in list(self.lost.items()):
            if w.t >= back:
                del self.lost[node_id]
        for plan in self.plans.values():
            if plan.kind == "on-demand" and self._chance(self.p.demand_every_s):
                plan.in_use = not plan.in_use
                self.counts["demand"] += 1
            if plan.in_use:
                w.state.demand[plan.name] = T0 + w.t

    # -- the simulated agent ----------------------------------------------------------------------------

    def agent(self) -> None:
        """Report what the engines did by now; a lost node reports nothing (the scheduler fails its replicas)."""
        w = self.w
        for due, report in (
            (self.starting, self._starting),
            (self.ready_at, self._ready),
            (self.stop_at, self._stopped),
        ):
            for rid, at in list(due.items()):
                if at > w.t:
                    continue
                del due[rid]
                r = w.state.replicas.get(rid)
                if r is not None and r.node_id not in self.lost:
                    report(r)

    def _starting(self, r: R.Replica) -> None:
        if r.state == "placed":
            payload = R.ReplicaStarting(replica_id=r.id, node_id=r.node_id, pid=1, port=20000)
            self.w.emit(R.AGGREGATE, r.id, payload)

    def _ready(self, r: R.Replica) -> None:
        if r.state in ("placed", "starting"):
            payload = R.ReplicaReady(replica_id=r.id, node_id=r.node_id, pid=1, port=20000, url="http://x")
            self.w.emit(R.AGGREGATE, r.id, payload)

    def _stopped(self, r: R.Replica) -> None:
        if r.state == "draining":
            self.w.emit(R.AGGREGATE, r.id, R.ReplicaStopped(replica_id=r.id, node_id=r.node_id))

    def _agent_hears(self, new: Iterable[str], stops: Iterable[Stop]) -> None:
        w, rnd = self.w, self.agent_rnd
        for rid in new:
            self.starting[rid] = w.t + self.p.tick_s / 2
            gpu = bool(w.state.replicas[rid].gpus)
            self.ready_at[rid] = w.t + (rnd.uniform(60, 180) if gpu else rnd.uniform(20, 60))
        for s in stops:
            self.ready_at.pop(s.replica_id, None)
            self.stop_at[s.replica_id] = w.t + min(s.grace_s, rnd.uniform(2, 25))

    # -- one pass ----------------------------------------------------------------------------------------

    def tick(self) -> None:
        w = self.w
        self.churn()
        self.agent()
        up = [n for n in w.beats if n not in self.lost]
        if up:
            w.beat(*up)
        started = time.perf_counter()
        decisions = reconcile(w.state, w.clock(), CFG)
        self.pass_s.append(time.perf_counter() - started)
        pre = [d for d in decisions if isinstance(d, Preempt)]
        if pre:
            self._preempted(pre)
        new = w.commit(decisions)
        self._agent_hears(new, [d for d in decisions if isinstance(d, Stop)])
        self._check_nodes()
        self._check_winners()
        if w.t >= self.p.warmup_s:
            self._check_guarantees(decisions)
        if int(w.t / self.p.tick_s) % 60 == 0:
            w.state.forget_inactive(CFG.forget_after_s, T0 + w.t)
        w.advance(self.p.tick_s)

    def _preempted(self, pre: list[Preempt]) -> None:
        """Record the pass's preemptions, and whether each was needed: the same pass, preemption off,
        leaves its winner unplaceable."""
        w = self.w
        blocked = {d.model for d in reconcile(w.state, w.clock(), NO_PREEMPT) if isinstance(d, Blocked)}
        by_winner: dict[str, Preemption] = {}
        for d in pre:
            rec = by_winner.get(d.for_model)
            if rec is None:
                rec = by_winner[d.for_model] = Preemption(
                    t=w.t,
                    winner=d.for_model,
                    winner_class=d.for_class,
                    node_id=d.node_id,
                    victims=[],
                    held_until=d.held_until,
                    needed=d.for_model in blocked,
                )
                self.preemptions.append(rec)
            m = w.state.models.get(d.model)
            kind = "on-demand" if m is not None and m.min == 0 else d.capacity_class
            rec.victims += [(rid, kind) for rid in d.replicas]
            # Back and forth: this winner gave way to this victim's model within the hour before.
            if any(
                back.winner == d.model and any(v == d.for_model for v in back.victim_models) and w.t - back.t <= 3600
                for back in self.preemptions[-500:]
            ):
                rec.back_and_forth = True
            rec.victim_models.append(d.model)

    def _check_winners(self) -> None:
        w = self.w
        now = T0 + w.t
        for rec in self.preemptions:
            if rec.placed_t is not None or rec.wasted:
                continue
            at = T0 + rec.t
            # After the pass that preempted: a replica that pass placed (for an earlier preemption) is not this one's.
            since = [r for r in w.state.replicas_of(rec.winner) if r.placed_at > at]
            if since:
                rec.placed_t = w.t
                rec.elsewhere = all(r.node_id != rec.node_id for r in since)
            elif now >= rec.held_until:
                m = w.state.models.get(rec.winner)
                if m is None:
                    rec.wasted = f"{rec.winner} was removed before it was placed"
                else:
                    have = sum(1 for r in w.state.replicas_of(rec.winner) if r.active)
                    lower, _ = wanted_replicas(m, w.state.demand.get(rec.winner), now, CFG)
                    why = "no longer wanted more" if have >= lower else "still not placed"
                    took = sorted({r.model for r in w.state.replicas_on(rec.node_id) if r.placed_at > at})
                    if took:
                        why += f"; the room on {rec.node_id} went to {', '.join(took)}"
                    rec.wasted = f"t={rec.t:.0f}s {rec.winner} ({have} of {lower}): {why} at the hold's end"

    def _check_nodes(self) -> None:
        """No node holds more than it has, at any pass."""
        w = self.w
        for n in w.state.nodes.values():
            cap = n.capacity
            if cap is None:
                continue
            held = [r for r in w.state.replicas_on(n.id) if r.active or r.state == "draining"]
            if not held:
                continue
            cores = sum(r.cores for r in held)
            mem = sum(r.memory_bytes for r in held)
            gpus = [g for r in held for g in r.gpus]
            known = {g.index for g in cap.gpus}
            wrong = []
            if cap.cpus is not None and cores > cap.cpus:
                wrong.append(f"{cores} cores of {cap.cpus}")
            if cap.memory_total_bytes is not None and mem > cap.memory_total_bytes:
                wrong.append(f"{mem / GiB:.0f} GB of {cap.memory_total_bytes / GiB:.0f}")
            if len(gpus) != len(set(gpus)) or not set(gpus) <= known:
                wrong.append(f"GPUs {sorted(gpus)} of {sorted(known)}")
            if wrong:
                self.overcommits.append(f"t={w.t:.0f}s {n.id}: " + ", ".join(wrong))

    def _check_guarantees(self, decisions: list[Decision]) -> None:
        """Which tenants are below their guarantee after this pass (see the module's doc), and why."""
        w = self.w
        now = T0 + w.t
        held = QU.holdings(w.state)
        quotas = QU.quotas_by_scope(w.state)
        chains = QU.chains(w.state)
        below: dict[str, str] = {}
        wanted_gpus = wanted_cores = 0
        for name, m in w.state.models.items():
            lower, _ = wanted_replicas(m, w.state.demand.get(name), now, CFG)
            need = need_of(m.spec.profiles[0])
            wanted_gpus += lower * need.gpus
            wanted_cores += lower * need.cores
            have = sum(1 for r in w.state.replicas_of(name) if r.active)
            if have >= lower:
                continue
            plan = self.plans.get(name)
            kind = plan.kind if plan else "?"
            self.short[kind] = self.short.get(kind, 0.0) + (lower - have) * self.p.tick_s / 60
            chain = chains.get(name)
            if not chain or chain[0] in below:
                continue
            q = quotas.get(chain[0])
            if q is None or q.guarantee.is_empty():
                continue
            h = held.get(chain[0], QU.ZERO)
            g = (q.guarantee.gpus, q.guarantee.cores, q.guarantee.memory_bytes)
            if QU._within([h.gpus, h.cores, h.memory_bytes], g, (need.gpus, need.cores, need.memory_bytes)):
                below[chain[0]] = name
        self.wanted.append((wanted_gpus / self.fleet_gpus, wanted_cores / self.fleet_cores))
        what_if: dict[str, list[Decision]] = {}
        for path, row in self.rows.items():
            scope = f"team:{path.replace('/', '.')}"
            if scope in below:
                since = self._below_since.setdefault(path, w.t)
                row.minutes_below += self.p.tick_s / 60
                row.longest_below_s = max(row.longest_below_s, w.t - since + self.p.tick_s)
                model = below[scope]
                row.models_below[model] = row.models_below.get(model, 0.0) + self.p.tick_s
                cause = self._cause(model, decisions, what_if)
                row.causes[cause] = row.causes.get(cause, 0.0) + self.p.tick_s
            else:
                self._below_since.pop(path, None)

    def _cause(self, model: str, decisions: list[Decision], what_if: dict[str, list[Decision]]) -> str:
        """Why a model whose tenant is below its guarantee is short after this pass: what the pass decided
        for it and, when it was blocked, whether a looser rule would have made room (the committed state
        asked again, with replicas of any age and up to 20 victims on a node)."""
        for d in decisions:
            if isinstance(d, Preempt) and d.for_model == model:
                return "preempting"
            if isinstance(d, Waiting) and d.model == model:
                if d.why.startswith("waiting for"):
                    return "victims draining"
                return "held back after giving way" if d.why.startswith("gave room") else "backing off"
        if not any(isinstance(d, Blocked) and d.model == model for d in decisions):
            return "not tried"
        w = self.w
        for label, cfg in (
            ("only replicas under 5 minutes old could give way", Config(preempt_min_age_s=0.0)),
            ("more than 3 victims on one node needed", Config(preempt_min_age_s=0.0, preempt_max_victims=20)),
        ):
            if label not in what_if:
                what_if[label] = reconcile(w.state, w.clock(), cfg)
            if any(isinstance(d, Preempt) and d.for_model == model for d in what_if[label]):
                return label
        return "nothing may give way"

    # -- the day -----------------------------------------------------------------------------------------

    def run(self) -> Report:
        started = time.perf_counter()
        self.setup()
        models_at_start = len(self.plans)
        end = self.p.hours * 3600
        while self.w.t < end:
            self.tick()
        wall = time.perf_counter() - started
        given: dict[str, int] = {}
        for rec in self.preemptions:
            for _, kind in rec.victims:
                given[kind] = given.get(kind, 0) + 1
        ms = sorted(s * 1000 for s in self.pass_s)
        for row in self.rows.values():
            row.minutes_below = round(row.minutes_below, 2)
        return Report(
            scenario=self.p.scenario,
            guarantee_share=self.share,
            hours=self.p.hours,
            seed=self.p.seed,
            nodes=self.p.nodes,
            fleet_gpus=self.fleet_gpus,
            fleet_cores=self.fleet_cores,
            tenants=len(self.tenants),
            models_at_start=models_at_start,
            models_added=self.counts["added"],
            models_removed=self.counts["removed"],
            scalings=self.counts["scalings"],
            nodes_lost=self.counts["lost"],
            demand_changes=self.counts["demand"],
            passes=len(self.pass_s),
            wanted_gpus=_mean_peak([g for g, _ in self.wanted]),
            wanted_cores=_mean_peak([c for _, c in self.wanted]),
            replica_minutes_short={k: round(v, 1) for k, v in sorted(self.short.items())},
            preemptions=len(self.preemptions),
            replicas_given_way=dict(sorted(given.items())),
            needed=sum(rec.needed for rec in self.preemptions),
            back_and_forth=sum(rec.back_and_forth for rec in self.preemptions),
            winners_placed=sum(rec.placed_t is not None for rec in self.preemptions),
            placed_elsewhere=sum(rec.elsewhere for rec in self.preemptions),
            wasted=sum(bool(rec.wasted) for rec in self.preemptions),
            wasted_why=[rec.wasted for rec in self.preemptions if rec.wasted],
            open_at_end=sum(rec.placed_t is None and not rec.wasted for rec in self.preemptions),
            tenant_rows=list(self.rows.values()),
            overcommits=self.overcommits[:20],
            wall_s=round(wall, 2),
            pass_median_ms=round(statistics.median(ms), 3),
            pass_p90_ms=round(ms[max(0, int(0.9 * len(ms)) - 1)], 3),
            pass_max_ms=round(ms[-1], 3),
        )


def simulate(p: Params) -> Report:
    return Churn(p).run()


def _mean_peak(xs: list[float]) -> tuple[float, float]:
    return (round(statistics.fmean(xs), 3), round(max(xs), 3)) if xs else (0.0, 0.0)


def _spread(total: int, shares: list[float]) -> list[int]:
    raw = [total * s / sum(shares) for s in shares]
    out = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def _pick(rnd: random.Random, weighted: tuple[tuple[str, float], ...]) -> str:
    x = rnd.random() * sum(w for _, w in weighted)
    for name, w in weighted:
        x -= w
        if x < 0:
            return name
    return weighted[-1][0]


def render(r: Report) -> str:
    lines = [
        f"scenario {r.scenario}: guarantees sum to {r.guarantee_share:.0%} of the fleet "
        f"({r.nodes} nodes, {r.fleet_gpus} GPUs, {r.fleet_cores} cores; {r.tenants} tenants)",
        f"  {r.hours:g} h, seed {r.seed}: {r.passes} passes; {r.models_at_start} models at start, "
        f"{r.models_added} added, {r.models_removed} removed, {r.scalings} scalings, {r.nodes_lost} nodes lost, "
        f"{r.demand_changes} on-demand changes",
        f"  wanted: GPUs {r.wanted_gpus[0]:.0%} of the fleet on average, {r.wanted_gpus[1]:.0%} at peak; "
        f"cores {r.wanted_cores[0]:.0%}, {r.wanted_cores[1]:.0%} at peak; replica-minutes short: "
        + (", ".join(f"{k} {v:.0f}" for k, v in r.replica_minutes_short.items()) or "none"),
        f"  wall {r.wall_s:.1f} s; reconcile pass median {r.pass_median_ms:.2f} ms, p90 {r.pass_p90_ms:.2f} ms, "
        f"max {r.pass_max_ms:.1f} ms",
        f"  preemptions {r.preemptions} ({sum(r.replicas_given_way.values())} replicas given way: "
        + ", ".join(f"{k} {v}" for k, v in r.replicas_given_way.items())
        + f"); needed {r.needed}; back and forth within the hour {r.back_and_forth}; "
        f"winner placed within the hold {r.winners_placed} "
        f"({r.placed_elsewhere} on another node than the victims'); wasted {r.wasted}; "
        f"open at the end {r.open_at_end}",
    ]
    lines += [f"    wasted: {why}" for why in r.wasted_why[:10]]
    lines.append(f"  {'tenant':<8} {'guarantee':>18} {'min below':>10} {'longest s':>10}  most below")
    for row in r.tenant_rows:
        worst = max(row.models_below.items(), key=lambda kv: kv[1], default=("", 0.0))
        g = f"{row.guarantee_gpus} GPUs {row.guarantee_cores} c"
        most = f"{worst[0]} ({worst[1] / 60:.1f} min)" if worst[0] else ""
        lines.append(f"  {row.tenant:<8} {g:>18} {row.minutes_below:>10.1f} {row.longest_below_s:>10.0f}  {most}")
    causes: dict[str, float] = {}
    for row in r.tenant_rows:
        for k, v in row.causes.items():
            causes[k] = causes.get(k, 0.0) + v
    if causes:
        lines.append(
            "  below guarantee, by cause (minutes): "
            + ", ".join(f"{k} {v / 60:.1f}" for k, v in sorted(causes.items(), key=lambda kv: -kv[1]))
        )
    lines.append(f"  overcommits: {len(r.overcommits)}" + "".join(f"\n    {o}" for o in r.overcommits[:5]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--scenario", choices=[*SCENARIOS, "both"], default="both")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    names = list(SCENARIOS) if args.scenario == "both" else [args.scenario]
    reports = [simulate(Params(scenario=s, hours=args.hours, seed=args.seed, nodes=args.nodes)) for s in names]
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(reports)).decode())
    else:
        print("\n\n".join(render(r) for r in reports))


if __name__ == "__main__":
    main()
