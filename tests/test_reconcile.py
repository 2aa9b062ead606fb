"""The reconcile pass (SCHED-2, SCHED-4, FLEET-2, FLEET-4) as tables of sentences, over a ClusterState
folded from events: no NATS, no clock but the one each test moves."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.services.scheduler.vocabulary import Blocked, Config, Place, Stop, Waiting, backoff_s
from tests.scheduler_world import (
    CFG,
    CPU_2C_8G,
    CPU_8C_32G,
    GPU_H100X8,
    GPU_L4X1,
    T0,
    Fact,
    World,
    beats,
    demand,
    failed,
    later,
    model,
    node,
    on_model,
    on_node,
    on_replica,
    placed,
    ready,
    said,
    shaped,
    spec,
    stopped,
)

LOST = N.NodeLost(node_id="", last_seen=datetime.fromtimestamp(T0, UTC), silent_s=31.0)


def lost(node_id: str) -> Fact:
    return on_node(node_id, msgspec.structs.replace(LOST, node_id=node_id))


def cordoned(node_id: str, reason: str = "maintenance") -> Fact:
    return on_node(node_id, N.NodeCordoned(node_id=node_id, reason=reason))


def drained(node_id: str, grace_s: float = 300.0) -> Fact:
    return on_node(node_id, N.NodeDrainRequested(node_id=node_id, grace_s=grace_s))


def draining(replica_id: str) -> Fact:
    return on_replica(replica_id, R.ReplicaStopRequested(replica_id=replica_id, reason="test"))


def scaled(name: str, lo: int, hi: int) -> Fact:
    return on_model(name, M.ModelScaled(min=lo, max=hi))


def failures(
    name: str, node_id: str, n: int, reason: str = "engine exited with 1", first: int = 1, node_lost: bool = False
) -> list[Fact]:
    """``n`` replicas of ``name`` placed on ``node_id`` that failed to start, all now."""
    out: list[Fact] = []
    for i in range(first, first + n):
        out += [placed(f"f{i}", name, node_id), failed(f"f{i}", reason, node_lost=node_lost)]
    return out


# -- one pass ------------------------------------------------------------------------------------

PASSES: list[tuple[str, list[Fact], list[str]]] = [
    # placing up to min
    (
        "a model is placed up to its min, one replica on each node",
        [node("a"), node("b"), model("m", 2)],
        ["place m on a", "place m on b"],
    ),
    ("a model at its min is left alone", [node("a"), model("m"), placed("r1", "m", "a"), ready("r1")], []),
    ("a placed replica counts towards min before it is ready", [node("a"), model("m"), placed("r1", "m", "a")], []),
    ("an on-demand model (min 0) gets nothing by itself", [node("a"), model("m", 0)], []),
    (
        "a model with no profile is blocked, and says so",
        [node("a"), on_model("m", M.ModelAdded(spec=msgspec.structs.replace(spec("m"), profiles=[])))],
        ["blocked m (1 wanted): model m has no profile"],
    ),
    (
        "a scheduler that has heard from no node yet waits for one before calling a model unplaceable",
        [model("m"), later(10)],
        ["waiting m until t=30"],
    ),
    (
        "with still no node registered once the wait is over, the model is blocked and the reason says to start "
        "an agent",
        [model("m"), later(31)],
        [
            "blocked m (1 wanted): no nodes have registered: start an agent (`llmgw agent`) "
            "or check that agents reach NATS"
        ],
    ),
    # filters
    (
        "a cordoned node takes nothing new",
        [node("a"), cordoned("a"), node("b"), model("m", 2)],
        ["place m on b", "place m on b"],
    ),
    ("a cordoned node keeps the replicas it has", [node("a"), model("m"), placed("r1", "m", "a"), cordoned("a")], []),
    (
        "a node without the profile's engine is passed over",
        [node("a", engines=["llamacpp"]), node("b", engines=["vllm"]), model("m", engine="vllm")],
        ["place m on b"],
    ),
    (
        "a node selector is honoured",
        [node("a", labels={"zone": "x"}), node("b", labels={"zone": "y"}), model("m", selector={"zone": "y"})],
        ["place m on b"],
    ),
    (
        "an old agent that reports neither CPUs nor memory still takes a replica (missing data constrains nothing)",
        [node("a", cpus=None, mem_gb=None), model("m", cores=4, mem=8)],
        ["place m on a"],
    ),
    (
        "a node not registered yet is registered, and takes nothing in the same pass",
        [node("a", register=False), model("m")],
        ["waiting m until t=30", "register a"],
    ),
    (
        "a node whose heartbeat shows more memory than it registered with is updated (a node that grows is seen to "
        "grow)",
        [node("a", mem_gb=64), node("a", mem_gb=128, register=False)],
        ["update a"],
    ),
    # never over-commit
    (
        "a pass never over-commits a node's cores when placing several replicas",
        [node("a", cpus=8, mem_gb=64), model("m1", 2, cores=3), model("m2", 2, cores=3)],
        [
            "blocked m2 (2 wanted): no node fits — a: has 8 CPUs with 2 free, needs 3",
            "place m1 on a",
            "place m1 on a",
        ],
    ),
    (
        "a pass never over-commits a node's memory when placing several replicas",
        [node("a", cpus=16, mem_gb=16), model("m", 3, mem=6, cores=2)],
        [
            "blocked m (1 wanted): no node fits — a: has 16.0 GB memory with 4.0 GB free, needs 6.0 GB",
            "place m on a",
            "place m on a",
        ],
    ),
    (
        "a llama.cpp replica with no cores given reserves the half of the node its threads will use",
        [node("a", cpus=4, mem_gb=64), model("m", 3, mem=1)],
        [
            "blocked m (1 wanted): no node fits — a: has 4 CPUs with 0 free, needs 2",
            "place m on a",
            "place m on a",
        ],
    ),
    (
        "a pass never gives one GPU to two replicas",
        [shaped("a", GPU_H100X8), model("g", 5, mem=None, gpus=2, engine="vllm")],
        [
            "blocked g (1 wanted): no node fits — a: has 8 GPUs, 0 free, needs 2",
            "place g on a gpus 0,1",
            "place g on a gpus 2,3",
            "place g on a gpus 4,5",
            "place g on a gpus 6,7",
        ],
    ),
    (
        "what replicas hold on a node counts while they run or drain, not once they failed or stopped",
        [
            node("a", cpus=16),
            model("x", cores=4),
            model("m", cores=9),
            placed("x1", "x", "a"),
            placed("x2", "x", "a"),
            failed("x2"),
            placed("x3", "x", "a"),
            stopped("x3"),
            placed("x4", "x", "a"),
            draining("x4"),
        ],
        ["blocked m (1 wanted): no node fits — a: has 16 CPUs with 8 free, needs 9"],
    ),
    (
        "GPU profiles pack: the replica goes where it leaves the fewest free GPUs",
        [
            shaped("a", GPU_H100X8),
            shaped("b", GPU_H100X8),
            model("x", gpus=6, mem=None, engine="vllm"),
            placed("x1", "x", "a"),
            model("g", gpus=2, mem=None, engine="vllm"),
        ],
        ["place g on a gpus 6,7"],
    ),
    (
        "Blocked names every node and what it lacks",
        [
            node("a", cpus=8),
            node("b"),
            cordoned("b"),
            node("c", engines=["vllm"]),
            node("d", labels={"zone": "x"}),
            model("m", cores=12, selector={"zone": "y"}),
        ],
        [
            "blocked m (1 wanted): no node fits — a: label zone=y missing; has 8 CPUs with 8 free, needs 12 | "
            "b: cordoned (maintenance) | c: cannot run llamacpp (engines: vllm); label zone=y missing | "
            "d: label zone=y missing (has zone=x)"
        ],
    ),
    # scaling down
    (
        "above max, a replica that is not ready yet is stopped first, even if older",
        [
            node("a"),
            node("b"),
            model("m", 2),
            placed("r1", "m", "a"),
            later(1),
            placed("r2", "m", "b"),
            ready("r2"),
            scaled("m", 1, 1),
        ],
        ["stop r1: model m scaled to max 1"],
    ),
    (
        "above max, a replica on the node holding most of the model's replicas goes, the newest there first",
        [
            node("a"),
            node("b"),
            model("m", 3),
            placed("r1", "m", "a"),
            placed("r2", "m", "b"),
            later(1),
            placed("r3", "m", "a"),
            ready("r1", "r2", "r3"),
            scaled("m", 2, 2),
        ],
        ["stop r3: model m scaled to max 2"],
    ),
    (
        "above max, with one replica on each node, the one on the busiest node goes",
        [
            node("a"),
            node("b"),
            model("x"),
            placed("x1", "x", "b"),
            model("m", 2),
            placed("r1", "m", "b"),
            later(1),
            placed("r2", "m", "a"),
            ready("x1", "r1", "r2"),
            scaled("m", 1, 1),
        ],
        ["stop r1: model m scaled to max 1"],
    ),
    (
        "scaling down stops as many replicas as are above max",
        [
            node("a"),
            model("m", 3),
            placed("r1", "m", "a"),
            later(1),
            placed("r2", "m", "a"),
            later(1),
            placed("r3", "m", "a"),
            ready("r1", "r2", "r3"),
            scaled("m", 1, 1),
        ],
        ["stop r2: model m scaled to max 1", "stop r3: model m scaled to max 1"],
    ),
    (
        "between min and max nothing is stopped",
        [node("a"), model("m"), placed("r1", "m", "a"), placed("r2", "m", "a"), scaled("m", 1, 3)],
        [],
    ),
    # nodes lost and returned
    (
        "a node silent past lost_after_s is lost, its replicas failed and replaced on another node in the same pass",
        [
            node("a"),
            node("b"),
            node("c"),
            model("m", 2),
            placed("r1", "m", "a"),
            placed("r2", "m", "b"),
            ready("r1", "r2"),
            later(31),
            beats("a", "c"),
        ],
        ["fail r2: node b lost: no heartbeat for 31s", "lost b", "place m on c"],
    ),
    ("a node silent for less than lost_after_s is kept", [node("a"), model("m", 0), later(29)], []),
    (
        "a node registered before this scheduler started is given lost_after_s from the start to report",
        [node("a", heard=False), later(29)],
        [],
    ),
    (
        "a node registered before this scheduler started that never reports is lost",
        [node("a", heard=False), later(30)],
        ["lost a"],
    ),
    ("a lost node that reports again returns", [node("a"), lost("a"), later(5), beats("a")], ["returned a"]),
    (
        "a lost node takes nothing, even in the pass that sees it return",
        [node("a"), lost("a"), later(5), beats("a"), model("m")],
        ["blocked m (1 wanted): no node fits — a: lost (no heartbeat)", "returned a"],
    ),
    (
        "a replica still active on a lost node is failed and replaced",
        [node("a"), node("b"), model("m"), placed("r1", "m", "a"), lost("a"), later(40), beats("b")],
        ["fail r1: node a lost", "place m on b"],
    ),
    # failed starts: backoff and parking
    (
        "after a failed start the model waits backoff_base_s before the next attempt",
        [node("a"), model("m"), *failures("m", "a", 1), later(1)],
        ["waiting m until t=2"],
    ),
    (
        "once the backoff has passed the model is placed again",
        [node("a"), model("m"), *failures("m", "a", 1), later(2)],
        ["place m on a"],
    ),
    (
        "the backoff doubles with each failed start: base·2^(n-1)",
        [node("a"), model("m"), *failures("m", "a", 3), later(7)],
        ["waiting m until t=8"],
    ),
    (
        "after park_after failed starts in a row the model is parked, with the last error",
        [node("a"), model("m"), *failures("m", "a", 5, reason="out of memory")],
        ["park m: 5 failed starts in a row; last: out of memory"],
    ),
    (
        "a replica that becomes ready clears the count of failed starts",
        [node("a"), model("m", 2), *failures("m", "a", 4), placed("r1", "m", "a"), ready("r1")],
        ["place m on a"],
    ),
    (
        "a ready replica of an older profile does not clear the failed starts",
        [node("a"), model("m", 2), *failures("m", "a", 4), placed("r1", "m", "a", stale=True), ready("r1")],
        ["waiting m until t=16"],
    ),
    (
        "replicas failed because their node was lost do not count towards parking",
        [node("a"), model("m"), *failures("m", "a", 6, reason="its machine vanished", node_lost=True)],
        ["place m on a"],
    ),
    (
        "a start failure whose message begins with 'node' still counts towards parking",
        [node("a"), model("m"), *failures("m", "a", 5, reason="node ran out of memory loading the weights")],
        ["park m: 5 failed starts in a row; last: node ran out of memory loading the weights"],
    ),
    (
        "a changed definition clears the failed starts",
        [node("a"), model("m"), *failures("m", "a", 5), on_model("m", M.ModelChanged(spec=spec("m", mem=2)))],
        ["place m on a"],
    ),
    # what must not run
    (
        "a stopped model's replicas are stopped",
        [node("a"), model("m"), placed("r1", "m", "a"), on_model("m", M.ModelStopped(saved_min=1, saved_max=1))],
        ["stop r1: model m stopped by an administrator"],
    ),
    (
        "a parked model's replicas that have not started are stopped",
        [node("a"), model("m"), placed("r1", "m", "a"), on_model("m", M.ModelParked(reason="boom", failures=5))],
        ["stop r1: model m parked: boom"],
    ),
    (
        "a parked model's ready replicas of an earlier definition keep serving",
        [
            node("a"),
            model("m"),
            placed("r1", "m", "a"),
            ready("r1"),
            on_model("m", M.ModelChanged(spec=spec("m", mem=2.0), what="resources")),
            placed("r2", "m", "a"),
            on_model("m", M.ModelParked(reason="boom", failures=5)),
        ],
        ["stop r2: model m parked: boom"],
    ),
    (
        "the replicas of a removed model are stopped",
        [node("a"), model("m"), placed("r1", "m", "a"), on_model("m", M.ModelRemoved())],
        ["stop r1: model m was removed"],
    ),
    (
        "a replica already draining is not stopped twice",
        [
            node("a"),
            model("m"),
            placed("r1", "m", "a"),
            on_model("m", M.ModelRemoved()),
            ready("r1"),
            lambda w: w.commit(w.run()),
        ],
        [],
    ),
    # on demand (SCHED-12)
    (
        "an on-demand model that was asked for gets one replica",
        [node("a"), model("m", 0), demand("m")],
        ["place m on a"],
    ),
    (
        "an on-demand model's replica is stopped once no request came for idle_s",
        [node("a"), model("m", 0), placed("r1", "m", "a"), ready("r1"), demand("m"), later(300), beats("a")],
        ["stop r1: idle on-demand model m: no request for 300s"],
    ),
    (
        "an on-demand model's replica on a drained node waits for its replacement while the model is in use",
        [node("a"), node("b"), model("m", 0), placed("r1", "m", "a"), ready("r1"), demand("m"), drained("a")],
        ["place m on b"],
    ),
    # drain
    (
        "a drained node's replica is replaced elsewhere first, and not stopped yet",
        [node("a"), node("b"), model("m"), placed("r1", "m", "a"), ready("r1"), drained("a")],
        ["place m on b"],
    ),
    (
        "a drained node's replica is stopped once a replacement is ready",
        [
            node("a"),
            node("b"),
            model("m"),
            placed("r1", "m", "a"),
            placed("r2", "m", "b"),
            ready("r1", "r2"),
            drained("a"),
        ],
        ["stop r1: node a drained"],
    ),
    (
        "a drained node's replica keeps serving while there is no room for a replacement",
        [node("a"), node("b", cpus=2), model("m", cores=4), placed("r1", "m", "a"), ready("r1"), drained("a")],
        ["blocked m (1 wanted): no node fits — a: draining | b: has 2 CPUs with 2 free, needs 4"],
    ),
    (
        "a drained node's replica is stopped at the end of the drain's grace even with no room elsewhere",
        [
            node("a"),
            node("b", cpus=2),
            model("m", cores=4),
            placed("r1", "m", "a"),
            ready("r1"),
            drained("a", grace_s=120),
            later(120),
            beats("a", "b"),
        ],
        [
            "blocked m (1 wanted): no node fits — a: draining | b: has 2 CPUs with 2 free, needs 4",
            "stop r1: node a drained; no replacement was ready elsewhere within the drain's 120s, "
            "so m is short until a node has room",
        ],
    ),
]


@pytest.mark.parametrize(("facts", "expected"), [c[1:] for c in PASSES], ids=[c[0] for c in PASSES])
def test_one_pass(facts: list[Fact], expected: list[str]) -> None:
    w = World().add(*facts)
    assert sorted(said(d) for d in w.run()) == sorted(expected)


# -- several passes ------------------------------------------------------------------------------


def test_a_lost_node_is_replaced_elsewhere_then_returns_and_takes_replicas_again() -> None:
    w = World().add(node("a"), node("b"), node("c"), model("m", 2))
    w.add(placed("r1", "m", "a"), placed("r2", "m", "b"), ready("r1", "r2"))
    w.advance(31).beat("a", "c")
    first = w.step()
    assert sorted(map(said, first)) == ["fail r2: node b lost: no heartbeat for 31s", "lost b", "place m on c"]
    assert w.state.nodes["b"].lost and w.state.replicas["r2"].state == "failed"
    assert w.nodes_of("m") == ["a", "c"]
    assert w.state.models["m"].failures == 0, "a node failure does not count towards parking"
    assert w.step() == [], "the next pass has nothing to do"

    w.advance(3).beat()
    assert [said(d) for d in w.step()] == ["returned b"]
    assert not w.state.nodes["b"].lost
    w.add(scaled("m", 3, 3))
    assert [said(d) for d in w.step()] == ["place m on b"], "the returned node is the one without a replica"


def test_a_node_lost_again_and_again_never_parks_its_model() -> None:
    w = World().add(node("n0"), model("m"))
    w.step()
    for i in range(1, CFG.park_after + 2):
        w.advance(CFG.lost_after_s).add(node(f"n{i}"))  # every node but the newest goes silent
        lines = sorted(map(said, w.step()))
        assert lines[0].startswith("fail ") and lines[1:] == [f"lost n{i - 1}", f"place m on n{i}"]
        assert w.state.models["m"].failures == 0
    assert not w.state.models["m"].parked


def test_failed_starts_back_off_then_park_and_retry_unparks() -> None:
    w = World().add(node("a"), model("m"))
    waits: list[float] = []
    for n in range(1, CFG.park_after + 1):
        (rid,) = w.commit(w.run())
        w.add(failed(rid, f"exit {n}"))
        decisions = w.run()
        if n < CFG.park_after:
            (wait,) = decisions
            assert isinstance(wait, Waiting)
            waits.append(wait.until - T0 - w.t)
            w.advance(wait.until - T0 - w.t).beat()
    assert waits == [backoff_s(n, CFG) for n in range(1, CFG.park_after)] == [2, 4, 8, 16]
    assert [said(d) for d in decisions] == ["park m: 5 failed starts in a row; last: exit 5"]
    w.commit(decisions)
    assert w.state.models["m"].parked
    assert w.step() == [], "a parked model is not placed"
    w.add(on_model("m", M.ModelRetried()))
    assert [said(d) for d in w.step()] == ["place m on a"]


def test_a_drain_places_the_replacement_first_and_stops_the_old_replica_once_it_is_ready() -> None:
    w = World().add(node("a"), node("b"), model("m"), placed("r1", "m", "a"), ready("r1"))
    w.add(drained("a", grace_s=120))
    assert [said(d) for d in w.step()] == ["place m on b"]
    (new,) = [r for r in w.active("m") if r != "r1"]
    assert w.step() == [], "the old replica serves while the replacement starts"
    w.add(ready(new))
    (stop,) = w.step()
    assert isinstance(stop, Stop) and stop.replica_id == "r1" and stop.grace_s == 120
    assert w.active("m") == [new]
    assert w.step() == []


def test_scaling_up_and_down_never_leaves_more_than_max_active() -> None:
    w = World().add(node("a"), node("b"), node("c"), model("m", 3))
    w.step()
    w.add(ready(*w.active("m")))
    assert len(w.active("m")) == 3
    for lo, hi in [(1, 1), (2, 4), (0, 0), (2, 2)]:
        w.add(scaled("m", lo, hi))
        for _ in range(3):
            w.step()
            assert len(w.active("m")) <= hi
        assert lo <= len(w.active("m")) <= hi


def test_blocked_carries_a_verdict_per_node() -> None:
    w = World().add(node("a", cpus=8), node("b", cpus=2), model("x", 1, cores=6), placed("x1", "x", "a"))
    w.add(model("m", 1, cores=4))
    (blocked,) = w.run()
    assert isinstance(blocked, Blocked) and blocked.wanted == 1
    assert {v.node_id: v.reasons for v in blocked.verdicts} == {
        "a": ["has 8 CPUs with 2 free, needs 4"],
        "b": ["has 2 CPUs with 2 free, needs 4"],
    }


def test_a_pass_does_not_change_the_state_it_reads() -> None:
    w = World().add(node("a"), node("b"), model("m", 3), model("x", 1, cores=2), later(40), beats("a"))
    before = msgspec.json.encode([w.state.nodes, w.state.models, w.state.replicas])
    w.run()
    assert msgspec.json.encode([w.state.nodes, w.state.models, w.state.replicas]) == before


def test_the_lost_limit_is_configurable() -> None:
    w = World().add(node("a"), later(10))
    assert w.run(Config(lost_after_s=60)) == []
    assert [said(d) for d in w.run(Config(lost_after_s=5))] == ["lost a"]


def test_a_replica_placed_without_cores_records_the_share_it_reserved_which_its_agent_runs_with() -> None:
    from llmgw.agent.engines.commands import choose_threads
    from llmgw.services.scheduler.vocabulary import Place

    w = World().add(node("a", cpus=8, mem_gb=64), node("b", cpus=2, mem_gb=64), model("m", 2, mem=1))
    placed = {d.node_id: d.need.cores for d in w.run() if isinstance(d, Place)}
    assert placed == {"a": 4, "b": 1}
    # The agent's --threads is the reservation, whatever its own default would be.
    assert choose_threads(placed["a"], configured=6, cpus=8) == 4


# -- profile choice (CAT-2) ----------------------------------------------------------------------


def two_profiles(name: str, min: int = 1, *, gpu_priority: int = 10, cpu_weight: int = 1) -> Fact:
    """A model that prefers vLLM on one GPU and falls back to llama.cpp on two cores."""
    gpu = M.Profile(name="gpu", engine="vllm", gpus=M.GpuRequest(count=1, min_memory_gb=20), priority=gpu_priority)
    cpu = M.Profile(name="cpu", engine="llamacpp", cpu_cores=2, min_memory_gb=1, weight=cpu_weight)
    spec = M.ModelSpec(name=name, source=f"/models/{name}", scaling=M.Scaling(min=min), profiles=[cpu, gpu])
    return lambda w: w.emit(M.AGGREGATE, name, M.ModelAdded(spec=spec))


def placed_profiles(w: World) -> list[tuple[str, str, str]]:
    return [
        (d.node_id, w.state.models[d.model].spec.profiles[d.profile].name, d.why)
        for d in w.run()
        if isinstance(d, Place)
    ]


def test_the_preferred_profile_is_placed_where_it_fits() -> None:
    w = World().add(shaped("g", GPU_L4X1), shaped("c", CPU_8C_32G), two_profiles("m"))
    [(node, profile, why)] = placed_profiles(w)
    assert (node, profile) == ("g", "gpu") and "preferred" not in why


def test_a_model_whose_preferred_profile_fits_nowhere_runs_on_its_fallback_and_says_why() -> None:
    w = World().add(shaped("c", CPU_8C_32G), two_profiles("m"))
    [(node, profile, why)] = placed_profiles(w)
    assert (node, profile) == ("c", "cpu")
    assert "profile cpu (preferred gpu fits nowhere: c: cannot run vllm" in why


def test_profiles_are_tried_by_priority_then_weight_then_as_listed() -> None:
    from llmgw.services.scheduler.placement import profile_order

    p = [
        M.Profile(name="a", priority=0, weight=1),
        M.Profile(name="b", priority=5, weight=1),
        M.Profile(name="c", priority=5, weight=3),
        M.Profile(name="d", priority=0, weight=1),
    ]
    assert [p[i].name for i in profile_order(p)] == ["c", "b", "a", "d"]


def test_when_no_profile_fits_the_refusal_names_what_each_one_lacks() -> None:
    w = World().add(shaped("s", CPU_2C_8G), two_profiles("m", 2))  # room for one replica on two cores
    [blocked] = [d for d in w.run() if isinstance(d, Blocked)]
    assert blocked.wanted == 1
    assert blocked.reason.startswith("profile gpu: no node fits — s: cannot run vllm")
    assert " · profile cpu: no node fits — s: has 2 CPUs with 0 free, needs 2" in blocked.reason


def test_the_placed_event_carries_the_profile_the_replica_runs() -> None:
    from llmgw.services.scheduler.vocabulary import event_of

    w = World().add(shaped("c", CPU_8C_32G), two_profiles("m"))
    [place] = [d for d in w.run() if isinstance(d, Place)]
    _, _, payload = event_of(place, w.state, replica_id="r1", term=1, last_seen=datetime.fromtimestamp(T0, UTC))
    assert isinstance(payload, R.ReplicaPlaced)
    assert (payload.profile.name, payload.profile.engine, payload.cores) == ("cpu", "llamacpp", 2)


def test_explain_names_the_profiles_that_fit_nowhere_and_the_one_a_replica_would_run() -> None:
    from llmgw.services.scheduler.explain import explain

    w = World().add(shaped("c", CPU_8C_32G), two_profiles("m"))
    body = explain(w.state, "m", CFG)
    assert [(t["profile"], t["fitting_nodes"]) for t in body["profiles"]] == [("gpu", 0), ("cpu", 1)]
    assert (body["needs"]["profile"], body["needs"]["cores"]) == ("cpu", 2)
    assert body["nodes"] == [{"node": "c", "fits": True, "lacks": [], "score": body["nodes"][0]["score"]}]
