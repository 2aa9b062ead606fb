"""Capacity classes and preemption (SCHED-7), as tables of sentences over a ClusterState folded from
events, then as stories of several passes. No NATS: the pure pass and the events it writes."""

from __future__ import annotations

import copy

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.events.schema import models as M
from llmgw.services.scheduler import preemption as PRE
from llmgw.services.scheduler.explain import explain
from llmgw.services.scheduler.headroom import headroom
from llmgw.services.scheduler.metrics import FleetCollector
from llmgw.services.scheduler.vocabulary import Preempt, Stop
from tests.scheduler_world import (
    CFG,
    T0,
    Fact,
    World,
    beats,
    demand,
    later,
    model,
    node,
    on_model,
    placed,
    ready,
    said,
    stopped,
)
from tests.test_quota_rules import quota, tree

OLD = 600.0  # older than the 5 minutes under which a replica is never taken


def aged(seconds: float = OLD) -> list[Fact]:
    return [later(seconds), beats()]


def running(replica_id: str, model_name: str, node_id: str) -> list[Fact]:
    return [placed(replica_id, model_name, node_id), ready(replica_id)]


def preempted(decisions: list) -> list[str]:
    """The replicas the pass stops to make room (each also has its ``model.preempted``)."""
    ids = sorted(rid for d in decisions if isinstance(d, Preempt) for rid in d.replicas)
    stops = sorted(d.replica_id for d in decisions if isinstance(d, Stop) and d.reason.startswith("preempted"))
    assert ids == stops, "every replica given way has its stop, and no other stop says preempted"
    return ids


def full(node_id: str = "a", cpus: int = 8) -> Fact:
    return node(node_id, cpus=cpus, mem_gb=64)


# (sentence, facts, replicas the pass preempts)
RULES: list[tuple[str, list[Fact], list[str]]] = [
    (
        "a critical model that fits nowhere takes an opportunistic replica's room",
        [
            full(),
            model("low", cores=8, cls="opportunistic"),
            *running("l1", "low", "a"),
            *aged(),
            model("hi", cores=8, cls="critical"),
        ],
        ["l1"],
    ),
    (
        "a standard model takes the room of an opportunistic model's minimum",
        [
            full(),
            model("low", cores=8, cls="opportunistic"),
            *running("l1", "low", "a"),
            *aged(),
            model("std", cores=8),
        ],
        ["l1"],
    ),
    (
        "an on-demand model with no class is opportunistic, so a standard model takes its room",
        [full(), model("od", 0, cores=8), *running("o1", "od", "a"), *aged(), model("std", cores=8)],
        ["o1"],
    ),
    (
        "a higher class never gives way to a lower one",
        [
            full(),
            model("std", cores=8),
            *running("s1", "std", "a"),
            *aged(),
            model("low", cores=8, cls="opportunistic"),
        ],
        [],
    ),
    (
        "within a class a replica at its model's minimum never gives way",
        [full(), model("s1m", cores=8), *running("s1", "s1m", "a"), *aged(), model("s2m", cores=8)],
        [],
    ),
    (
        "within a class an extra replica gives way to a model below its minimum",
        [
            full("a"),
            full("b", cpus=10),
            model("big", 1, cores=8, max=2),
            model("crit", cores=2, cls="critical"),
            *running("b1", "big", "a"),
            *running("b2", "big", "b"),
            *running("c1", "crit", "b"),  # b would hold more replicas after the stop: a is the better node
            *aged(),
            model("new", cores=8),
        ],
        ["b1"],
    ),
    (
        "within a class an extra does not give way to an on-demand model in use (it is not below its minimum)",
        [
            full("a"),
            full("b"),
            model("big", 1, cores=8, max=2),
            *running("b1", "big", "a"),
            *running("b2", "big", "b"),
            *aged(),
            model("od", 0, cores=8, cls="standard"),
            demand("od"),
        ],
        [],
    ),
    (
        "a critical model's minimum is never taken, even for another critical model",
        [
            full(),
            model("c1", cores=8, cls="critical"),
            *running("k1", "c1", "a"),
            *aged(),
            model("c2", cores=8, cls="critical"),
        ],
        [],
    ),
    (
        "a critical model's extra gives way to a critical model below its minimum",
        [
            full("a"),
            full("b", cpus=10),
            model("c1", 1, cores=8, max=2, cls="critical"),
            model("c3", cores=2, cls="critical"),
            *running("k1", "c1", "a"),
            *running("k2", "c1", "b"),
            *running("k3", "c3", "b"),
            *aged(),
            model("c2", cores=8, cls="critical"),
        ],
        ["k1"],
    ),
    (
        "a replica younger than five minutes is never taken",
        [
            full(),
            model("low", cores=8, cls="opportunistic"),
            *running("l1", "low", "a"),
            *aged(299),
            model("hi", cores=8, cls="critical"),
        ],
        [],
    ),
    (
        "nothing is stopped when even every victim on a node would not make room",
        [
            node("a", cpus=8, mem_gb=16),
            model("low", cores=4, mem=8, cls="opportunistic"),
            *running("l1", "low", "a"),
            *aged(),
            model("hi", cores=4, mem=32, cls="critical"),
        ],
        [],
    ),
    (
        "at most three replicas give way for one placement",
        [
            full(),
            model("low", 4, cores=2, cls="opportunistic"),
            *running("l1", "low", "a"),
            *running("l2", "low", "a"),
            *running("l3", "low", "a"),
            *running("l4", "low", "a"),
            *aged(),
            model("hi", cores=8, cls="critical"),
        ],
        [],
    ),
    (
        "three replicas give way when three make room",
        [
            full(),
            model("low", 4, cores=2, cls="opportunistic"),
            *running("l1", "low", "a"),
            *running("l2", "low", "a"),
            *running("l3", "low", "a"),
            *running("l4", "low", "a"),
            *aged(),
            model("hi", cores=6, cls="critical"),
        ],
        ["l1", "l2", "l3"],
    ),
    (
        "an idle on-demand replica gives way before an opportunistic model's minimum",
        [
            full(),
            model("low", cores=4, cls="opportunistic"),
            model("od", 0, cores=4),
            *running("l1", "low", "a"),
            *running("o1", "od", "a"),
            *aged(),
            model("hi", cores=4, cls="critical"),
        ],
        ["o1"],
    ),
    (
        "a lower class's extra gives way before its minimum",
        [
            full(cpus=12),
            model("low", 1, cores=4, max=2, cls="opportunistic"),
            model("other", cores=4, cls="opportunistic"),
            *running("l1", "low", "a"),
            *running("l2", "low", "a"),
            *running("x1", "other", "a"),
            later(100),
            model("hi", cores=4, cls="critical"),
            *aged(),
        ],
        ["l1"],
    ),
    (
        "the longest unused model gives way first",
        [
            full(),
            model("busy", cores=4, cls="opportunistic"),
            model("quiet", cores=4, cls="opportunistic"),
            *running("b1", "busy", "a"),
            *running("q1", "quiet", "a"),
            demand("quiet"),
            later(100),
            demand("busy"),
            *aged(),
            model("hi", cores=4, cls="critical"),
        ],
        ["q1"],
    ),
    (
        "of replicas unused as long, the smallest that makes room gives way",
        [
            full(),
            model("small", cores=3, cls="opportunistic"),
            model("large", cores=5, cls="opportunistic"),
            *running("s1", "small", "a"),
            *running("g1", "large", "a"),
            *aged(),
            model("hi", cores=3, cls="critical"),
        ],
        ["s1"],
    ),
    (
        "the set is pruned to what the placement needs",
        [
            full(),
            model("od", 0, cores=1),
            model("low", cores=7, cls="opportunistic"),
            *running("o1", "od", "a"),
            *running("l1", "low", "a"),
            *aged(),
            model("hi", cores=7, cls="critical"),
        ],
        ["l1"],
    ),
    (
        "nothing gives way where a node has room",
        [
            full("a"),
            full("b"),
            model("low", cores=8, cls="opportunistic"),
            *running("l1", "low", "a"),
            *aged(),
            model("hi", cores=8, cls="critical"),
        ],
        [],
    ),
    (
        "the node giving up fewest replicas is chosen",
        [
            full("a"),
            full("b"),
            model("low", 3, cores=4, cls="opportunistic"),
            *running("l1", "low", "a"),
            *running("l2", "low", "a"),
            *running("l3", "low", "b"),
            model("other", cores=4, cls="opportunistic"),
            *running("x1", "other", "b"),
            *aged(),
            model("hi", cores=8, cls="critical"),
        ],
        ["l1", "l2"],
    ),
]


# With quotas over the tenancy tree (SCHED-8): acme/ml is guaranteed 8 cores, beta/ml nothing.
TEAMS = [tree("acme", "acme/ml", "beta", "beta/ml"), quota("acme/ml", cores=8)]
RULES += [
    (
        "a replica within its scope's guarantee is never taken for another scope, even by a critical model",
        [
            *TEAMS,
            full(),
            model("ours", cores=8, cls="opportunistic", owner="acme/ml"),
            *running("o1", "ours", "a"),
            *aged(),
            model("theirs", cores=8, cls="critical", owner="beta/ml"),
        ],
        [],
    ),
    (
        "a scope within its guarantee takes back what another scope borrowed, whatever its class",
        [
            *TEAMS,
            full(),
            model("lent", cores=8, owner="beta/ml"),
            *running("b1", "lent", "a"),
            *aged(),
            model("ours", cores=8, cls="opportunistic", owner="acme/ml"),
        ],
        ["b1"],
    ),
    (
        "a borrowed critical minimum is not taken back",
        [
            *TEAMS,
            full(),
            model("lent", cores=8, cls="critical", owner="beta/ml"),
            *running("b1", "lent", "a"),
            *aged(),
            model("ours", cores=8, owner="acme/ml"),
        ],
        [],
    ),
    (
        "a scope beyond its guarantee takes nothing back",
        [
            *TEAMS,
            full("a"),
            full("b"),
            model("ours", cores=8, owner="acme/ml"),
            model("lent", cores=8, owner="beta/ml"),
            *running("o1", "ours", "a"),
            *running("b1", "lent", "b"),
            *aged(),
            model("more", cores=8, cls="opportunistic", owner="acme/ml"),
        ],
        [],
    ),
]


@pytest.mark.parametrize(("facts", "expected"), [c[1:] for c in RULES], ids=[c[0] for c in RULES])
def test_preemption_rule(facts: list[Fact], expected: list[str]) -> None:
    w = World().add(*facts)
    assert preempted(w.run()) == expected


def test_each_preemption_is_an_event_with_its_cause_and_the_victim_drains_with_thirty_seconds_grace() -> None:
    w = World().add(full(), model("low", cores=8, cls="opportunistic"), *running("l1", "low", "a"), *aged())
    w.add(model("hi", cores=8, cls="critical"))
    lines = sorted(said(d) for d in w.run())
    assert lines == [
        "blocked hi (1 wanted): no node fits — a: has 8 CPUs with 0 free, needs 8",
        "preempt l1 of low (opportunistic) for hi: gave room to hi (critical) on a: lower class",
        "stop l1: preempted: gave room to hi (critical) on a: lower class",
    ] or lines == [
        "preempt l1 of low (opportunistic) for hi: gave room to hi (critical) on a: lower class",
        "stop l1: preempted: gave room to hi (critical) on a: lower class",
    ]
    stop = next(d for d in w.run() if isinstance(d, Stop))
    assert stop.grace_s == 30.0
    w.step()
    low = w.state.models["low"]
    assert low.preempted is not None and low.preempted.for_model == "hi" and low.preempted.replicas == ["l1"]
    assert low.status.preemptions == 1


def test_the_winner_is_placed_once_the_victim_stops_and_the_victim_waits_meanwhile() -> None:
    w = World().add(full(), model("low", cores=8, cls="opportunistic"), *running("l1", "low", "a"), *aged())
    w.add(model("hi", cores=8, cls="critical"))
    w.step()
    # While l1 drains, the winner waits for it rather than taking anything more.
    assert [said(d) for d in w.run() if d.model == "hi"] == [  # type: ignore[union-attr]
        f"waiting hi until t={OLD + 300:g}: waiting for 1 replicas that gave way to drain"
    ]
    w.add(stopped("l1"))
    decisions = w.step()
    assert "place hi on a" in [said(d) for d in decisions]
    # The victim's model was held back while the winner was not yet placed: it never raced for the room.
    assert not any(isinstance(d, Preempt) for d in decisions)
    assert [said(d) for d in w.run() if d.model == "low"] == [  # type: ignore[union-attr]
        "blocked low (1 wanted): no node fits — a: has 8 CPUs with 0 free, needs 8"
    ]


def test_a_victim_model_is_held_back_until_the_winner_is_placed() -> None:
    w = World().add(
        full("a"), full("b", cpus=2), model("low", cores=8, cls="opportunistic"), *running("l1", "low", "a")
    )
    w.add(*aged(), model("hi", cores=8, cls="critical"))
    w.step()
    w.add(stopped("l1"))
    # Before the winner's pass, low is held back: it does not take the room that was just freed.
    held = [said(d) for d in w.run() if d.model == "low"]  # type: ignore[union-attr]
    assert held == [f"waiting low until t={OLD + 300:g}: gave room to hi"]


def test_the_hold_ends_after_five_minutes_even_when_the_winner_was_never_placed() -> None:
    w = World().add(full(), model("low", cores=8, cls="opportunistic"), *running("l1", "low", "a"), *aged())
    w.add(model("hi", cores=8, cls="critical"))
    w.step()
    w.add(stopped("l1"), on_removed("hi"), later(301), beats())
    assert [said(d) for d in w.run()] == ["place low on a"]


def on_removed(name: str) -> Fact:
    return lambda w: w.emit(M.AGGREGATE, name, M.ModelRemoved())


def test_each_replica_given_way_is_counted_by_model_and_class_for_prometheus() -> None:
    w = World().add(full(), model("low", cores=8, cls="opportunistic"), *running("l1", "low", "a"), *aged())
    w.add(model("hi", cores=8, cls="critical"))
    w.step()
    collector = FleetCollector("sched-a", lambda: w.state, lambda: True, list, CFG, now=lambda: T0 + w.t)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        if family.name == "llmgw_model_preempted"
        for s in family.samples
    }
    assert samples[("llmgw_model_preempted_total", (("class", "opportunistic"), ("model", "low")))] == 1.0
    assert samples[("llmgw_model_preempted_total", (("class", "critical"), ("model", "hi")))] == 0.0


def test_one_replica_gives_way_only_once_in_a_pass() -> None:
    w = World().add(full(), model("low", cores=8, cls="opportunistic"), *running("l1", "low", "a"), *aged())
    w.add(model("hi1", cores=8, cls="critical"), model("hi2", cores=8, cls="critical"))
    assert preempted(w.run()) == ["l1"]


def test_headroom_counts_no_room_that_only_preemption_would_make() -> None:
    w = World().add(full(), model("low", cores=8, cls="opportunistic"), *running("l1", "low", "a"), *aged())
    w.add(model("hi", cores=8, cls="critical"))
    assert headroom(w.state, "hi", w.clock(), CFG)["more"] == 0


def test_preemption_can_be_turned_off() -> None:
    w = World().add(full(), model("low", cores=8, cls="opportunistic"), *running("l1", "low", "a"), *aged())
    w.add(model("hi", cores=8, cls="critical"))
    assert preempted(w.run(msgspec.structs.replace(CFG, preempt=False))) == []


# -- properties ----------------------------------------------------------------------------------

CLASSES = ("opportunistic", "standard", "critical")


@st.composite
def fleets(draw: st.DrawFn) -> World:
    """A few 8-core nodes, filled with replicas of several models of random classes, minimums and ages
    (each model at or above its minimum, and in use), then a model of a random class that fits nowhere."""
    w = World()
    nodes = draw(st.integers(1, 3))
    for i in range(nodes):
        w.add(full(f"n{i}"))
    free = {f"n{i}": 8 for i in range(nodes)}
    for j in range(draw(st.integers(1, 5))):
        name = f"m{j}"
        cores = draw(st.integers(1, 4))
        w.add(model(name, 1, cores=cores, cls=draw(st.sampled_from(CLASSES))))
        count = 0
        for k in range(draw(st.integers(1, 3))):
            where = [n for n, f in sorted(free.items()) if f >= cores]
            if not where:
                break
            n = draw(st.sampled_from(where))
            free[n] -= cores
            w.add(*running(f"{name}-{k}", name, n))
            count += 1
        lo = draw(st.integers(0, count))
        w.add(on_model(name, M.ModelScaled(min=lo, max=count)), *([demand(name)] if count else []))
        w.add(later(draw(st.sampled_from([60.0, 200.0, 400.0]))), beats())
    w.add(model("win", draw(st.integers(0, 1)), cores=draw(st.integers(2, 8)), cls=draw(st.sampled_from(CLASSES))))
    w.add(demand("win"))
    return w


@settings(max_examples=200, deadline=None)
@given(fleets())
def test_no_victim_breaks_a_rule_and_every_set_is_needed_and_makes_room(w: World) -> None:
    decisions = w.run()
    victims = preempted(decisions)
    if not victims:
        return
    assert {d.for_model for d in decisions if isinstance(d, Preempt)} == {"win"}
    win = w.state.models["win"]
    win_cls = PRE.class_of(win.spec, win.min)
    assert len(victims) <= PRE.MAX_VICTIMS
    for rid in victims:
        r = w.state.replicas[rid]
        m = w.state.models[r.model]
        cls = PRE.class_of(m.spec, m.min)
        assert T0 + w.t - r.placed_at >= PRE.MIN_AGE_S, "never a replica younger than five minutes"
        assert PRE.RANK[cls] <= PRE.RANK[win_cls], "never a higher class for a lower"
        live = sum(1 for x in w.state.replicas_of(r.model) if x.active)
        taken = sum(1 for v in victims if w.state.replicas[v].model == r.model)
        if cls == "critical":
            assert live - taken >= m.min, "never a critical minimum"
        if cls == win_cls:
            assert live - taken >= m.min and win.min > 0, "within a class only extras, for a model below its minimum"
    # The set makes room: once its replicas stop, the winner is placed on that node; and it is needed:
    # with any one of them left running, it would not be.
    node_id = w.state.replicas[victims[0]].node_id
    w.commit(decisions)
    for spared in victims if len(victims) > 1 else []:
        partial = copy.deepcopy(w)
        partial.add(*[stopped(rid) for rid in victims if rid != spared])
        assert f"place win on {node_id}" not in [said(d) for d in partial.run()], f"{spared} was not needed"
    w.add(*[stopped(rid) for rid in victims])
    assert f"place win on {node_id}" in [said(d) for d in w.run()]


@settings(max_examples=60, deadline=None)
@given(fleets())
def test_the_same_cluster_gives_the_same_preemption(w: World) -> None:
    assert [said(d) for d in w.run()] == [said(d) for d in w.run()]


def test_explain_names_the_replicas_that_would_give_way_and_why() -> None:
    w = World().add(full(), model("low", cores=8, cls="opportunistic"), *running("l1", "low", "a"), *aged())
    w.add(model("hi", cores=8, cls="critical"))
    body = explain(w.state, "hi", CFG, clock=w.clock())
    assert body["preemption"] == "l1 of low would give way: gave room to hi (critical) on a: lower class"
    assert body["capacity_class"] == "critical"


def test_explain_says_when_nothing_may_give_way_naming_the_class() -> None:
    w = World().add(full(), model("std", cores=8), *running("s1", "std", "a"), *aged())
    w.add(model("low", cores=8, cls="opportunistic"))
    body = explain(w.state, "low", CFG, clock=w.clock())
    assert body["summary"] == (
        "0 of 1 nodes could take another replica; nothing may give way to a opportunistic model: no replica of "
        "a lower class, nor an extra of its own class, older than 5 minutes and outside other scopes' guarantees "
        "makes room on any node"
    )
    assert body["capacity_class"] == "opportunistic"


def test_explain_says_a_model_that_gave_way_is_held_back_and_for_whom() -> None:
    w = World().add(full(), model("low", cores=8, cls="opportunistic"), *running("l1", "low", "a"), *aged())
    w.add(model("hi", cores=8, cls="critical"))
    w.step()
    w.add(stopped("l1"), model("other", cores=8, cls="critical"), *running("x1", "other", "a"))
    body = explain(w.state, "low", CFG, clock=w.clock())
    assert "it gave room to hi and is held back until that model is placed or the hold ends" in body["summary"]
