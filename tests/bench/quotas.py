"""What capacity quotas (SCHED-8) cost the scheduler, at 1,000 nodes, 5,000 replicas and 50 tenants.

    .venv/bin/python -m tests.bench.quotas [--nodes 1000] [--models 500] [--replicas 5000] [--runs 50]

The cluster is `llmgw bench scheduler`'s simulated one (bench/scheduler.py: every model at its min,
every replica ready), plus a tenancy tree of 50 tenants — 10 orgs, 2 teams each, one project in
each team — every one with a quota (a guarantee and a limit of GPUs, cores and memory, high enough
that nothing is blocked, so the passes compare like for like), and every model owned by one of
them, round-robin. Timed, in one process, median and p90 of ``--runs`` calls:

- **ledger**: what a placing pass pays for quota accounting (``Ledger``: every model's owner chain
  and every scope's holdings) right after a replica, owner or quota changed; the target is 5 ms;
  **ledger, kept**: the same while nothing changed (the state keeps what it derived);
- **shares**: the guarantees' protected and borrowed replicas after a change (what preemption asks);
- **view**: `ctl quota list`'s answer;
- **pass.lost** with quotas against the same pass with no owners and no quotas: a pass that
  replaces the replicas of one lost node, so it places and pays for the ledger; reported as the
  ratio of the medians;
- **pass.preempting** with quotas against the same without (a critical model that fits only once a
  replica gives way), alternated, and against the steady pass; **pass.preempting, q., replica** is
  the first such pass after a replica changed (the covers of the scopes above it derived again),
  **pass.preempting, q., quota** the first after a quota changed (every scope's cover derived again).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from datetime import UTC, datetime

import msgspec

from llmgw.bench.scheduler import CFG, NOW, PREEMPT_TARGET_MS, T0, clock, lost_clock, measure, preempting, simulate
from llmgw.events.schema import models as M
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.subjects import event_subject
from llmgw.services.scheduler.headroom import headroom
from llmgw.services.scheduler.quota import Ledger, guarantee_shares, quota_view
from llmgw.services.scheduler.reconcile import reconcile
from llmgw.services.scheduler.state import ClusterState
from llmgw.services.scheduler.vocabulary import Place

GiB = 1024**3
TARGET_MS = 5.0
HEADROOM_TARGET_MS = 50.0


def with_tenants(state: ClusterState, orgs: int = 10) -> tuple[ClusterState, int]:
    """A copy of ``state`` with a tree of ``orgs`` orgs (2 teams each, 2 projects per team), a quota on
    every scope and every model owned by one of them; the number of scopes."""
    out = copy.deepcopy(state)
    seq = out.position
    at = datetime.fromtimestamp(T0, UTC)

    def emit(aggregate: str, agg_id: str, payload: msgspec.Struct) -> None:
        nonlocal seq
        seq += 1
        env = Envelope(id=f"q{seq}", type="bench", at=at, actor="system:bench")
        out.apply(RecordedEvent(envelope=env, payload=payload, subject=event_subject(aggregate, agg_id), seq=seq))

    paths: list[tuple[str, str, str]] = []  # (id, kind, path)
    for o in range(orgs):
        org = f"org{o}"
        emit(T.AGGREGATE, T.TREE_ID, T.OrgCreated(org_id=org, name=org))
        paths.append((org, "org", org))
        for t in range(2):
            team = f"{org}-t{t}"
            emit(T.AGGREGATE, T.TREE_ID, T.TeamCreated(team_id=team, org_id=org, name=f"t{t}"))
            paths.append((team, "team", f"{org}/t{t}"))
            for p in range(1):
                project = f"{team}-p{p}"
                emit(T.AGGREGATE, T.TREE_ID, T.ProjectCreated(project_id=project, team_id=team, name=f"p{p}"))
                paths.append((project, "project", f"{org}/t{t}/p{p}"))
    big = Q.Resources(gpus=10**6, cores=10**8, memory_bytes=10**8 * GiB)
    some = Q.Resources(gpus=8, cores=256, memory_bytes=1024 * GiB)
    for sid, kind, path in paths:
        emit(Q.AGGREGATE, sid, Q.QuotaSet(scope_id=sid, kind=kind, path=path, guarantee=some, limit=big))
    for i, name in enumerate(sorted(out.models)):
        m = out.models[name]
        spec = msgspec.structs.replace(m.spec, owner=paths[i % len(paths)][2])
        emit(M.AGGREGATE, name, M.ModelChanged(spec=spec, what="bench owner"))
    # A changed spec would make every replica a stale profile: keep the replicas' hash (quotas alone are timed).
    for name, m in out.models.items():
        m.starts = msgspec.structs.replace(m.starts, spec_hash=state.models[name].spec_hash)
    out.position = seq
    return out, len(paths)


def _ms(samples: list[float]) -> tuple[float, float]:
    ms = sorted(s * 1000 for s in samples)
    return round(statistics.median(ms), 3), round(ms[max(0, int(0.9 * len(ms)) - 1)], 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--models", type=int, default=500)  # as `llmgw bench scheduler`
    ap.add_argument("--replicas", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()

    base, sim = simulate(args.nodes, args.models, args.replicas)
    state, scopes = with_tenants(base)
    print(f"{sim.nodes:,} nodes, {sim.models:,} models, {sim.replicas:,} replicas ready; {scopes} scopes with quotas")
    rows: list[tuple[str, float, float]] = []

    def changed() -> ClusterState:
        """``state`` as right after a quota changed: nothing derived is kept."""
        state.changed()
        return state

    for name, fn in (
        ("ledger", lambda: Ledger(changed())),
        ("ledger, kept", lambda: Ledger(state)),
        ("shares", lambda: guarantee_shares(changed())),
        ("view", lambda: quota_view(changed())),
    ):
        rows.append((name, *_ms(measure(fn, args.runs))))

    clock_q, lost_q = lost_clock(state)
    clock_b, lost_b = lost_clock(base)
    placed_q = sum(isinstance(d, Place) for d in reconcile(state, clock_q, CFG))
    placed_b = sum(isinstance(d, Place) for d in reconcile(base, clock_b, CFG))
    # Alternate the two passes, so that the machine's drift falls on both alike.
    with_q: list[float] = []
    without: list[float] = []
    for _ in range(max(1, args.runs // 5)):
        with_q += measure(lambda: reconcile(state, clock_q, CFG), 5, min_runs=5, budget_s=5)
        without += measure(lambda: reconcile(base, clock_b, CFG), 5, min_runs=5, budget_s=5)
    q_med, q_p90 = _ms(with_q)
    b_med, b_p90 = _ms(without)
    rows += [("pass.lost, quotas", q_med, q_p90), ("pass.lost, none", b_med, b_p90)]

    state.nodes[lost_q].last_seen = NOW  # the lost node reports again: what follows is timed at rest
    base.nodes[lost_b].last_seen = NOW
    # Headroom for one model (SCHED-11): the real pass on a copy, asking for 256 more replicas of it.
    name = sorted(state.models)[len(state.models) // 2]
    rows.append(("headroom", *_ms(measure(lambda: headroom(state, name, clock(), CFG), max(5, args.runs // 5)))))
    # A pass that preempts (SCHED-7) under the quotas: a critical model of a new org guaranteed 8 GPUs
    # wants a whole 8-GPU node; it takes back capacity borrowed beyond the other scopes' guarantees.
    steady = reconcile(state, clock(), CFG)
    rows.append(("pass.steady, quotas", *_ms(measure(lambda: reconcile(state, clock(), CFG), args.runs))))
    new_org(state, "newco", gpus=8)
    victims = preempting(state, owner="newco")
    victims_b = preempting(base)
    pre_q: list[float] = []
    pre_b: list[float] = []
    for _ in range(max(1, args.runs // 5)):
        pre_q += measure(lambda: reconcile(state, clock(), CFG), 5, min_runs=5, budget_s=5)
        pre_b += measure(lambda: reconcile(base, clock(), CFG), 5, min_runs=5, budget_s=5)
    rows += [("pass.preempting, q.", *_ms(pre_q)), ("pass.preempting, none", *_ms(pre_b))]
    # The first pass after a replica changed covers the scopes above it again; after a quota, every scope.
    some_model = sorted(state.models)[0]

    def replica_changed() -> ClusterState:
        state.changed(some_model)
        return state

    rows.append(
        ("pass.preempting, q., replica", *_ms(measure(lambda: reconcile(replica_changed(), clock(), CFG), args.runs)))
    )
    rows.append(("pass.preempting, q., quota", *_ms(measure(lambda: reconcile(changed(), clock(), CFG), args.runs))))

    print(f"{'what':<28} {'median ms':>10} {'p90 ms':>10}")
    for name, med, p90 in rows:
        print(f"{name:<28} {med:>10.3f} {p90:>10.3f}")
    print(f"lost node {lost_q}: {placed_q} replicas placed with quotas, {placed_b} without ({lost_b})")
    ledger = rows[0][1]
    print(f"ledger {ledger:.3f} ms against a target of {TARGET_MS} ms: {'ok' if ledger <= TARGET_MS else 'MISSED'}")
    print(f"pass.lost with quotas / without: {q_med / b_med:.2f}")
    # The machine's load moves every figure alike: the ledger against the pass it is part of is steadier.
    print(f"ledger / pass.lost without quotas: {ledger / b_med:.3f}")
    figures = {name: med for name, med, _ in rows}
    print(
        f"headroom {figures['headroom']:.1f} ms against a target of {HEADROOM_TARGET_MS:g} ms: "
        f"{'ok' if figures['headroom'] <= HEADROOM_TARGET_MS else 'MISSED'}"
    )
    print(
        f"preempting pass ({victims} replica(s) give way; {len(steady)} decisions at rest before) "
        f"{figures['pass.preempting, q.']:.1f} ms against a target of {PREEMPT_TARGET_MS:g} ms: "
        f"{'ok' if figures['pass.preempting, q.'] <= PREEMPT_TARGET_MS else 'MISSED'}; "
        f"{figures['pass.preempting, q.'] / figures['pass.steady, quotas']:.2f}× the steady pass, "
        f"{figures['pass.preempting, q.'] / figures['pass.preempting, none']:.2f}× the same pass without quotas "
        f"({victims_b} replica(s) give way there)"
    )


def new_org(state: ClusterState, org: str, *, gpus: int) -> None:
    """An org with a guarantee of ``gpus`` GPUs and nothing held yet, folded into ``state``."""
    seq = state.position
    at = datetime.fromtimestamp(T0, UTC)
    for aggregate, agg_id, payload in (
        (T.AGGREGATE, T.TREE_ID, T.OrgCreated(org_id=org, name=org)),
        (Q.AGGREGATE, org, Q.QuotaSet(scope_id=org, kind="org", path=org, guarantee=Q.Resources(gpus=gpus))),
    ):
        seq += 1
        env = Envelope(id=f"n{seq}", type="bench", at=at, actor="system:bench")
        state.apply(RecordedEvent(envelope=env, payload=payload, subject=event_subject(aggregate, agg_id), seq=seq))


if __name__ == "__main__":
    main()
