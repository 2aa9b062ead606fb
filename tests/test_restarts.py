"""Restarts with surge (SCHED-6) as stories over a folded ClusterState: no NATS, the clock the test moves."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.events.folds import replicas as F
from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.events.schema.outcomes import Rejected
from llmgw.services.fleet.rules import decide_restart
from llmgw.services.scheduler import restarts
from llmgw.services.scheduler.vocabulary import Place, Stop, Waiting
from tests.scheduler_world import (
    CFG,
    CPU_8C_32G,
    GPU_L4X1,
    Fact,
    World,
    failed,
    later,
    model,
    node,
    on_model,
    on_replica,
    placed,
    ready,
    said,
    shaped,
    spec,
    stopped,
)
from tests.test_reconcile import two_profiles


def restart(*replica_ids: str) -> Fact:
    def fact(w: World) -> None:
        for rid in replica_ids:
            w.emit(R.AGGREGATE, rid, R.ReplicaRestartRequested(replica_id=rid, reason="test"))

    return fact


def serving(name: str, *where: tuple[str, str], min_: int | None = None, **more: object) -> list[Fact]:
    """Model ``name`` with one ready replica per (replica id, node)."""
    facts: list[Fact] = [model(name, min_ if min_ is not None else len(where), **more)]
    for rid, node_id in where:
        facts += [placed(rid, name, node_id), ready(rid)]
    return facts


def restart_of(w: World, rid: str) -> str:
    return w.state.replicas[rid].restart


def replacement_of(w: World, rid: str) -> str:
    (new,) = [r.id for r in w.state.replicas.values() if r.replaces == rid and r.active]
    return new


def test_a_requested_restart_places_a_replacement_first_and_stops_the_old_one_once_it_is_ready() -> None:
    w = World().add(node("a"), node("b"), *serving("m", ("r1", "a")), restart("r1"))
    assert restart_of(w, "r1") == "queued"
    (place,) = w.step()
    assert isinstance(place, Place) and place.replaces == "r1" and "replaces r1 (asked for)" in place.why
    new = replacement_of(w, "r1")
    assert restart_of(w, "r1") == "replacing"
    assert w.step() == [], "the old replica serves while its replacement starts"
    w.add(ready(new))
    assert [said(d) for d in w.step()] == [f"stop r1: restarted: replaced by {new}"]
    assert w.active("m") == [new]
    assert w.step() == []


def test_restarts_go_one_at_a_time_per_model() -> None:
    w = World().add(node("a"), node("b"), *serving("m", ("r1", "a"), ("r2", "b")), restart("r1", "r2"))
    assert [d.replaces for d in w.step() if isinstance(d, Place)] == ["r1"], "one replacement at a time"
    first = replacement_of(w, "r1")
    assert w.step() == []
    w.add(ready(first))
    assert [said(d) for d in w.step()] == [f"stop r1: restarted: replaced by {first}"]
    assert w.step() == [], "the next restart waits until the old replica has drained"
    w.add(stopped("r1"))
    (place,) = w.step()
    assert isinstance(place, Place) and place.replaces == "r2"
    w.add(ready(replacement_of(w, "r2")))
    w.step()
    w.add(stopped("r2"))
    assert w.step() == []
    assert len(w.active("m")) == 2 and not {"r1", "r2"} & set(w.active("m"))


def test_two_models_restart_side_by_side() -> None:
    w = World().add(node("a"), *serving("m", ("m1", "a")), *serving("x", ("x1", "a")), restart("m1", "x1"))
    assert sorted(d.replaces for d in w.step() if isinstance(d, Place)) == ["m1", "x1"]


def test_replicas_of_a_stale_profile_are_restarted_the_same_way() -> None:
    w = World().add(node("a"), node("b"), *serving("m", ("r1", "a"), ("r2", "b")))
    assert w.step() == []
    w.add(on_model("m", M.ModelChanged(spec=spec("m", 2, mem=2.0), what="resources")))
    (place,) = w.step()
    assert isinstance(place, Place) and place.replaces == "r1" and "stale profile" in place.why
    assert place.need.memory_bytes == 2 * 1024**3, "the replacement runs the model's current profile"
    w.add(ready(replacement_of(w, "r1")))
    w.step()
    w.add(stopped("r1"))
    (place,) = w.step()
    assert isinstance(place, Place) and place.replaces == "r2"


def test_a_stopped_model_s_stale_replicas_are_not_restarted() -> None:
    w = World().add(node("a"), *serving("m", ("r1", "a")), restart("r1"))
    w.add(on_model("m", M.ModelStopped(saved_min=1, saved_max=1)))
    assert [said(d) for d in w.run()] == ["stop r1: model m stopped by an administrator"]


def test_with_no_room_for_a_second_copy_the_old_one_stops_and_the_model_says_it_is_short() -> None:
    # One node with room for one replica of 40 GB.
    w = World().add(node("a", mem_gb=64), *serving("m", ("r1", "a"), mem=40.0), restart("r1"))
    (stop,) = w.step()
    assert isinstance(stop, Stop) and stop.short and stop.grace_s == CFG.stop_grace_s
    assert stop.reason == "restart of r1: no room for a second copy; model m is short until it is back"
    w.add(stopped("r1"))
    (place,) = w.step()
    assert isinstance(place, Place) and not place.replaces, "the normal pass places it again"


def test_a_restart_that_fits_nowhere_even_in_the_old_one_s_place_keeps_the_old_one_serving() -> None:
    w = World().add(node("a", mem_gb=64), *serving("m", ("r1", "a"), mem=40.0))
    w.add(on_model("m", M.ModelChanged(spec=spec("m", 1, mem=80.0), what="resources")))
    assert w.step() == []
    assert w.active("m") == ["r1"]


def test_a_failed_replacement_leaves_the_old_one_serving_and_the_restart_queued() -> None:
    w = World().add(node("a"), node("b"), *serving("m", ("r1", "a")), restart("r1"))
    w.step()
    new = replacement_of(w, "r1")
    w.add(failed(new, "engine exited with 1"))
    assert restart_of(w, "r1") == "queued"
    assert w.state.models["m"].failures == 1, "it counts like any failed start"
    (wait,) = w.run()
    assert isinstance(wait, Waiting), "the next try backs off"
    assert w.active("m") == ["r1"]
    w.advance(wait.until - w.clock().epoch).beat()
    (place,) = w.step()
    assert isinstance(place, Place) and place.replaces == "r1"


@pytest.mark.parametrize(("lo", "hi"), [(1, 1), (1, 3), (2, 2)])
def test_scale_down_never_counts_a_replacement_as_an_extra(lo: int, hi: int) -> None:
    w = World().add(node("a"), node("b"), *serving("m", ("r1", "a")), restart("r1"))
    w.step()
    new = replacement_of(w, "r1")
    w.add(on_model("m", M.ModelScaled(min=lo, max=hi)))
    for _ in range(3):
        decisions = w.step()
        assert not any(isinstance(d, Stop) and d.replica_id == new for d in decisions)
    assert set(w.active("m")) >= {new}


def test_the_fold_queues_a_restart_once_and_follows_its_replacement() -> None:
    old = F.Replica(id="r1", model="m", node_id="a", state="ready")
    asked = F.fold_replica(old, R.ReplicaRestartRequested(replica_id="r1"), 0.0)
    assert asked is not None and asked.restart == "queued"
    assert F.fold_replica(asked, R.ReplicaRestartRequested(replica_id="r1"), 0.0) is asked
    new = F.Replica(id="r2", model="m", node_id="b", state="placed", replaces="r1")
    assert F.fold_replaced(asked, new).restart == "replacing"
    assert F.fold_replaced(asked, msgspec.structs.replace(new, state="failed")).restart == "queued"
    gone = msgspec.structs.replace(asked, state="draining", restart="replacing")
    assert F.fold_replaced(gone, msgspec.structs.replace(new, state="failed")) is gone
    done = F.Replica(id="r3", model="m", node_id="a", state="stopped")
    assert F.fold_replica(done, R.ReplicaRestartRequested(replica_id="r3"), 0.0) is done, "only a running one restarts"


def test_the_restart_request_is_a_replica_event_everyone_folds() -> None:
    w = World().add(node("a"), *serving("m", ("r1", "a")))
    w.add(on_replica("r1", R.ReplicaRestartRequested(replica_id="r1")))
    assert w.state.replicas["r1"].restart == "queued" and w.state.replicas["r1"].state == "ready"


# -- the command (`ctl restart REPLICA`, the fleet service) ---------------------------------------


def _running(*ids: str, restart: str = "") -> dict[str, F.Replica]:
    return {rid: F.Replica(id=rid, model="m", node_id="a", state="ready", restart=restart) for rid in ids}


@pytest.mark.parametrize(
    ("replicas", "asked", "events", "says"),
    [
        (_running("r1"), "r1", 1, "replica r1 (m) restarts: a new copy starts first, then it stops"),
        (_running("r1", restart="queued"), "r1", 0, "replica r1 (m) is already restarting (queued)"),
        (_running("r1", "r2"), "rx", None, "there is no running replica 'rx' (running: r1, r2)"),
        ({}, "rx", None, "there is no running replica 'rx' (none is running)"),
    ],
)
def test_a_restart_is_asked_for_a_running_replica_and_an_unknown_one_is_refused_naming_those_that_run(
    replicas: dict[str, F.Replica], asked: str, events: int | None, says: str
) -> None:
    command = R.RestartReplica(replica_id=asked, reason="new weights")
    if events is None:
        with pytest.raises(Rejected) as refused:
            decide_restart(replicas, command)
        assert str(refused.value).startswith(says) and refused.value.code == "not_found"
        return
    decision = decide_restart(replicas, command)
    assert decision.message == says and len(decision.payloads) == events
    assert decision.payloads == [R.ReplicaRestartRequested(replica_id=asked, reason="new weights")][:events]


def test_a_scale_down_stops_a_replica_waiting_for_its_restart_first() -> None:
    w = World().add(node("a"), node("b"), model("m", 2), placed("r1", "m", "a", stale=True), ready("r1"))
    w.add(later(10), placed("r2", "m", "b"), ready("r2"), on_model("m", M.ModelScaled(min=1, max=1)))
    assert [said(d) for d in w.run()] == ["stop r1: model m scaled to max 1"], "not the newest, the stale one"


# -- a property: restarts never leave a model short while there is room, nor surge by more than one ----


@settings(max_examples=60, deadline=None)
@given(
    min_=st.integers(1, 3),
    asked=st.lists(st.integers(0, 2), max_size=3),
    change=st.booleans(),
    moves=st.lists(st.sampled_from(["ready", "fail", "stop", "pass"]), min_size=5, max_size=40),
)
def test_restarts_keep_a_model_at_strength_and_surge_by_one_at_most(
    min_: int, asked: list[int], change: bool, moves: list[str]
) -> None:
    w = World().add(node("a"), node("b"), node("c"), model("m", min_))
    w.step()
    w.add(ready(*w.active("m")))
    first = w.active("m")
    w.add(restart(*sorted({first[i] for i in asked if i < len(first)})))
    if change:
        w.add(on_model("m", M.ModelChanged(spec=spec("m", min_, mem=2.0), what="resources")))
    for move in moves:
        rs = list(w.state.replicas_of("m"))
        match move:
            case "ready":
                w.add(ready(*[r.id for r in rs if r.state == "placed"]))
            case "fail":  # a replacement fails to start
                w.add(*[failed(r.id) for r in rs if r.state == "placed" and r.replaces])
            case "stop":
                w.add(*[stopped(r.id) for r in rs if r.state == "draining"])
        w.advance(60).beat()  # past any backoff
        w.step()
        live = [r for r in w.state.replicas_of("m") if r.active]
        assert len(live) <= min_ + 1, "one surge replica at a time"
        assert sum(r.state == "ready" for r in live) >= min_, "a restart never takes a serving replica first"
    if w.state.models["m"].parked:
        # A new definition that never starts parks the model; the old replicas go on serving.
        live = [r for r in w.state.replicas_of("m") if r.active]
        assert sum(r.state == "ready" for r in live) >= min_
        return
    # Left to finish, every restart completes.
    for _ in range(3 * min_ + 3):
        w.add(ready(*[r.id for r in w.state.replicas_of("m") if r.state == "placed"]))
        w.add(*[stopped(r.id) for r in w.state.replicas_of("m") if r.state == "draining"])
        w.advance(60).beat()
        w.step()
    live = [r for r in w.state.replicas_of("m") if r.active]
    spec_hash = w.state.models["m"].spec_hash
    assert len(live) == min_ and not any(restarts.needs_restart(r, spec_hash) for r in live)


def test_a_replica_on_a_fallback_profile_moves_back_with_surge_once_the_preferred_one_fits_again() -> None:
    w = World().add(shaped("c", CPU_8C_32G), two_profiles("m"))
    w.step()
    [old] = w.active("m")
    w.add(ready(old))
    assert w.state.replicas[old].profile.name == "cpu"
    assert w.run() == []  # nothing better fits: it stays where it is

    w.add(shaped("g", GPU_L4X1))  # a GPU node joins: the preferred profile fits again
    [place] = [d for d in w.step() if isinstance(d, Place)]
    assert (place.node_id, place.replaces, w.state.models["m"].spec.profiles[place.profile].name) == ("g", old, "gpu")
    assert "on fallback profile cpu; preferred gpu fits again" in place.why
    [new] = [r for r in w.active("m") if r != old]
    assert w.run() == [], "the fallback copy serves until the preferred one is ready"
    w.add(ready(new))
    assert [said(d) for d in w.step()] == [f"stop {old}: restarted: replaced by {new}"]
    w.add(stopped(old))
    assert w.run() == [], "on its preferred profile, it stays"
